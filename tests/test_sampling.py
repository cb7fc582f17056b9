"""Rejection sampler, warping and draft sampling: crafted cases and exact distribution tests."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.runtime import sampling
from specdec.runtime.sampling import (
    TOP_P_CANDIDATES,
    DraftSample,
    Verdict,
    Warp,
    draw,
    position_generator,
    proposal_probability,
    rejection_sample,
    sample_draft_token,
    warped_probs,
)
from tests.helpers import in_two_processes
from tests.spec_oracle import (
    PASS_P,
    PLANTED_P,
    LogitFn,
    Sampler,
    chi_square,
    chi_square_pvalue,
    exact_distribution,
    proposal_matrix,
    random_logit_table,
    speculative_sequence,
)

V = 5


def one_hot_logits(ids: list[int], vocab: int = V) -> torch.Tensor:
    """Logits whose argmax at row i is ids[i]."""
    logits = torch.zeros(len(ids), vocab)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return logits


def test_greedy_all_accepted_gives_bonus() -> None:
    verdict = rejection_sample(one_hot_logits([1, 2, 3, 4]), torch.tensor([1, 2, 3]), None, Warp(), None)
    assert verdict == Verdict(num_accepted=3, token_ids=[1, 2, 3, 4])


def test_greedy_early_mismatch_recovers_target_token() -> None:
    verdict = rejection_sample(one_hot_logits([1, 0, 3, 4]), torch.tensor([1, 2, 3]), None, Warp(), None)
    assert verdict == Verdict(num_accepted=1, token_ids=[1, 0])


def test_greedy_first_token_wrong() -> None:
    verdict = rejection_sample(one_hot_logits([4, 2, 3, 4]), torch.tensor([1, 2, 3]), None, Warp(), None)
    assert verdict == Verdict(num_accepted=0, token_ids=[4])


def test_empty_block_samples_one_target_token() -> None:
    verdict = rejection_sample(one_hot_logits([3]), torch.tensor([], dtype=torch.long), None, Warp(), None)
    assert verdict == Verdict(num_accepted=0, token_ids=[3])
    sampled = rejection_sample(
        one_hot_logits([3]),
        torch.tensor([], dtype=torch.long),
        torch.zeros(0, V),
        Warp(1.0),
        torch.Generator().manual_seed(0),
    )
    assert sampled.num_accepted == 0 and len(sampled.token_ids) == 1


def test_sampled_identical_distributions_accept_everything() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([0, 1, 2])
    q = warped_probs(logits[:3], Warp(1.0))
    for seed in range(50):
        verdict = rejection_sample(logits, drafts, q, Warp(1.0), torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 3
        assert verdict.token_ids[:3] == [0, 1, 2]


def test_draft_token_with_zero_target_probability_is_always_rejected() -> None:
    logits = torch.tensor([[0.0, 0.0, -math.inf, 0.0, 0.0], [0.0] * V])
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    for seed in range(50):
        verdict = rejection_sample(logits, torch.tensor([2]), q, Warp(1.0), torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0
        assert verdict.token_ids[0] != 2


def test_draft_probability_zero_for_drafted_token_is_rejected_not_divided() -> None:
    logits = torch.zeros(2, V)
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]])  # claims token 0 was drafted with q(0) = 0
    for seed in range(20):
        verdict = rejection_sample(logits, torch.tensor([0]), q, Warp(1.0), torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0
        assert all(0 <= t < V for t in verdict.token_ids)


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        rejection_sample(torch.zeros(3, V), torch.tensor([1, 2, 3]), None, Warp(), None)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(4, V), torch.tensor([1, 2, 3]), None, Warp(1.0), None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_warp_rejects_bad_values(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Warp(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 0, 1.0, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (0.5, 20, 0.9, 0.0), (0.8, 40, 0.95, 0.05),
     (1.0, 1000, 0.9, 0.0), (1.0, 0, 1.0, 0.1), (1.0, 0, 0.6, 0.05), (1.0, 0, 0.95, 0.01), (0.6, 0, 1.0, 1.0)],
)  # fmt: skip
@pytest.mark.parametrize("vocab", [50, 151_936])
def test_warped_probs_match_hf_warpers(temperature: float, top_k: int, top_p: float, min_p: float, vocab: int) -> None:
    """A top-k of at most TOP_P_CANDIDATES applies top-p and min-p to the k ids it keeps only (a
    path of its own), as does a top-p whose cut lies among the most likely ids (top-p 0.6 here; at
    0.9 and 0.95 these rows' cut lies beyond them); min-p compares scores with log(min_p), not
    probabilities; every path gives HF's warpers' distribution, over Qwen2.5's vocabulary too."""
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    expected = scores.softmax(-1)
    got = warped_probs(logits, Warp(temperature, top_k, top_p, min_p))
    torch.testing.assert_close(got, expected)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(warped_probs(logits[1], Warp(temperature, top_k, top_p, min_p)), expected[1])


def test_top_k_keeps_every_id_that_ties_the_kth_score() -> None:
    """As HF's TopKLogitsWarper: ids equal to the k-th score all stay (more than k of them)."""
    logits = torch.tensor([[4.0, 1.0, 2.0, 2.0, 2.0, 0.5, -1.0, 3.0]])
    got = warped_probs(logits, Warp(1.0, top_k=3, top_p=0.99))
    expected = TopPLogitsWarper(0.99)(None, TopKLogitsWarper(3)(None, logits.clone())).softmax(-1)
    torch.testing.assert_close(got, expected)
    assert (got > 0).sum() == 5


@pytest.mark.parametrize(
    ("spread", "top_p", "fewest", "most"),
    [
        (8.0, 0.9, 1, TOP_P_CANDIDATES),  # the cut within the first candidates
        (3.0, 0.5, 100, TOP_P_CANDIDATES),
        (3.0, 0.95, 8 * TOP_P_CANDIDATES, 64 * TOP_P_CANDIDATES),  # the cut further out
        (0.05, 0.9, 64 * TOP_P_CANDIDATES, 151_935),  # flat: most of the row
        (1.0, 0.9, 64 * TOP_P_CANDIDATES, 151_935),
    ],
    ids=["peaked", "mid", "wide", "flat", "spread"],
)
def test_top_p_over_a_whole_vocabulary_keeps_the_sorted_prefix(
    spread: float, top_p: float, fewest: int, most: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2.5's 151,936 ids: top-p looks among the most likely first and, where the mass lies
    further out (flat rows), finds the cut in the whole row without selecting from it again (a
    flat row, the sampler's slowest, went through four selections of up to all its ids: 34 ms on
    the 2-core host, against ~6 ms); where the cut lies among the first, the probabilities are
    computed over those ids alone (no softmax of the whole row). It keeps the ids a sort of the
    whole row keeps (summing the same float32 probabilities in float64), up to ids within
    rounding of the cut; min-p (1e-6) keeps them all here."""
    logits = torch.randn(2, 151_936, generator=torch.Generator().manual_seed(5)) * spread
    widths: list[int] = []
    topk = torch.topk

    def counted(values: torch.Tensor, k: int, *args: object, **kwargs: object) -> object:
        widths.append(k)
        return topk(values, k, *args, **kwargs)  # type: ignore[arg-type]

    whole: list[int] = []  # softmaxes over every id
    softmax = torch.Tensor.softmax

    def watched(values: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if values.shape[-1] == logits.shape[-1]:
            whole.append(values.shape[-1])
        return softmax(values, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "topk", counted)
    monkeypatch.setattr(torch.Tensor, "softmax", watched)
    got = warped_probs(logits, Warp(1.0, top_p=top_p, min_p=1e-6))
    monkeypatch.undo()
    assert widths == [TOP_P_CANDIDATES]
    if most == TOP_P_CANDIDATES:  # the cut among the candidates: no pass over the row's ids but one
        assert whole == []
    probs = (logits - logits.max(-1, keepdim=True).values).softmax(-1).double()
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.empty_like(probs).scatter(-1, order, ordered.cumsum(-1) - ordered)
    reference = before < top_p
    differ = (got > 0) != reference
    assert all(fewest <= kept <= most for kept in (got > 0).sum(-1).tolist())
    assert bool(((before[differ] - top_p).abs() < 1e-7).all()) and int(differ.sum()) < 3
    torch.testing.assert_close(
        got, torch.where(got > 0, probs, 0.0).float() / (got > 0).mul(probs).sum(-1, True).float()
    )


@pytest.mark.parametrize("seed", range(6))
def test_top_p_of_flat_rows_with_ties_keeps_the_ids_a_stable_sort_keeps(seed: int) -> None:
    """Rows of 4,096 ids made of a few distinct probabilities, so that many ids tie at the cut,
    some of no mass, with leading dimensions: where the top 1,024 hold less than top-p (the cut
    found in the whole row, ``_wide_top_p_drop``), top-p keeps the ids a stable sort keeps (of ids of equal probability
    at the cut, the lowest), up to ids within float64 rounding of the cut; the most likely stays."""
    generator = torch.Generator().manual_seed(seed)
    levels = torch.rand(1 + seed, generator=generator) + 0.01
    weights = levels[torch.randint(0, levels.numel(), (2, 3, 4096), generator=generator)]
    weights[torch.rand(weights.shape, generator=generator) < 0.1] = 0.0
    probs = weights / weights.sum(-1, keepdim=True)
    ordered, order = torch.sort(probs.double(), dim=-1, descending=True, stable=True)
    before = torch.empty_like(ordered).scatter(-1, order, ordered.cumsum(-1) - ordered)
    wide = 0
    for top_p in (0.3, 0.5, 0.77, 0.999):
        for row, (row_probs, masses) in enumerate(zip(probs.view(-1, 4096), before.view(-1, 4096), strict=True)):
            if ordered.view(-1, 4096)[row, :TOP_P_CANDIDATES].sum() >= top_p:
                continue  # cut among the first candidates (ties there in the selection's order)
            wide += 1
            dropped = sampling._wide_top_p_drop(row_probs, top_p)
            reference = masses >= top_p
            reference[masses.argmin()] = False  # the most likely id (the first of a stable sort)
            differ = dropped != reference
            assert bool(((masses[differ] - top_p).abs() < 1e-9).all()), (top_p, row, int(differ.sum()))
            assert not dropped[masses.argmin()]
    assert wide >= 6


def test_draw_follows_the_distribution_and_never_draws_an_id_without_mass() -> None:
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.0])  # any positive total: a residual is not normalised
    generator = torch.Generator().manual_seed(7)
    counts = collections.Counter(draw(weights, generator) for _ in range(20_000))
    assert set(counts) == {1, 3, 4}
    assert chi_square([counts[i] for i in (1, 3, 4)], [0.3, 0.1, 0.6]) > 1e-4


def test_draw_is_a_function_of_the_generator() -> None:
    probs = torch.randn(1000, generator=torch.Generator().manual_seed(8)).softmax(-1)
    first = [draw(probs, position_generator(3, i, "target")) for i in range(50)]
    assert first == [draw(probs, position_generator(3, i, "target")) for i in range(50)]
    assert len(set(first)) > 10


def test_a_uniform_that_rounds_to_the_total_draws_the_last_id_with_mass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling.torch, "rand", lambda *_, **kw: torch.tensor(1.0, dtype=kw["dtype"]))
    assert draw(torch.tensor([0.2, 0.5, 0.3, 0.0, 0.0]), None) == 2


def test_draw_from_no_mass_is_an_error_of_the_request() -> None:
    from specdec.serving.errors import NumericalError

    for bad in (torch.zeros(4), torch.tensor([0.5, math.inf]), torch.tensor([math.nan, 1.0])):
        with pytest.raises(NumericalError):
            draw(bad, None)


def test_sparse_draft_samples_from_reported_distribution() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(2)) * 2
    counts = collections.Counter()
    sample = None
    gen = torch.Generator().manual_seed(3)
    for _ in range(4000):
        sample = sample_draft_token(logits, Warp(1.0), 3, gen)
        counts[sample.token_id] += 1
    assert sample is not None and sample.ids is not None and sample.probs is not None
    assert set(counts) <= set(sample.ids.tolist())
    q = proposal_matrix([sample], V)[0]
    expected = [float(q[t]) for t in sample.ids.tolist()]
    observed = [counts[t] for t in sample.ids.tolist()]
    assert chi_square(observed, expected) > 1e-4


@pytest.mark.parametrize(
    ("warp", "spread", "boost", "widths"),
    [
        (Warp(0.8), 2.0, 8.0, [64]),  # the top 64 of the whole row
        (Warp(0.8, top_p=0.9, min_p=0.05), 3.0, 40.0, [64]),  # the cut within the first 64
        (Warp(1.0, top_p=0.9), 4.2, 0.0, [64, TOP_P_CANDIDATES]),  # beyond them, within the 1,024
        (Warp(1.0, top_p=0.9), 0.3, 1.0, [64, TOP_P_CANDIDATES, 64]),  # in the whole row (flat)
        (Warp(1.0, top_k=40, top_p=0.95), 1.0, 4.0, [40]),  # fewer than 64 can have mass
        (Warp(1.0, top_k=200, min_p=0.2), 3.0, 12.0, [200]),
    ],
    ids=["temperature", "within-64", "within-1024", "flat", "top-k-40", "top-k-200"],
)
def test_a_top_n_draft_proposal_is_the_top_n_of_the_warped_distribution(
    warp: Warp, spread: float, boost: float, widths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampled draft token over Qwen2.5's 151,936 ids proposes the 64 most likely ids of the
    warped distribution, renormalised, and is drawn from them, without making the distribution's
    dense row: the top-n are the n best scores, found among the first 64 where top-p's cut lies
    there, else among the top 1,024 or in the whole row. Same ids and probabilities as the dense
    row's top 64 (ids without mass aside), the same token for the same generator."""
    logits = torch.randn(151_936, generator=torch.Generator().manual_seed(11)) * spread
    logits[:3] += boost  # a few likely ids, as a real model's row has
    seen: list[int] = []
    topk = torch.topk

    def counted(values: torch.Tensor, k: int, *args: object, **kwargs: object) -> object:
        seen.append(k)
        return topk(values, k, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "topk", counted)
    got = sample_draft_token(logits, warp, 64, torch.Generator().manual_seed(4))
    monkeypatch.undo()
    assert seen == widths
    assert got.ids is not None and got.probs is not None
    dense = warped_probs(logits, warp)
    expected, ids = torch.topk(dense, 64)
    expected = expected / expected.sum()
    mass = got.probs > 0
    assert got.ids[mass].tolist() == ids[expected > 0].tolist()
    torch.testing.assert_close(got.probs[mass], expected[expected > 0])
    assert got.token_id == int(ids[draw(expected, torch.Generator().manual_seed(4))])


def test_proposal_probability_is_the_drawn_token_s_probability_in_every_kind() -> None:
    """The draft's confidence stop reads it: the probability the token had in the distribution
    it was drawn from (the softmax of the logits for a greedy, one-hot sample)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    softmax = torch.softmax(logits, -1)
    greedy = sample_draft_token(logits, Warp(), 0, None)
    assert greedy.probs is None and proposal_probability(greedy, logits, Warp()) == pytest.approx(float(softmax[0]))
    gen = torch.Generator().manual_seed(0)
    dense = sample_draft_token(logits, Warp(0.5), 0, gen)
    q = warped_probs(logits, Warp(0.5))
    assert proposal_probability(dense, logits, Warp(0.5)) == pytest.approx(float(q[dense.token_id]))
    sparse = sample_draft_token(logits, Warp(1.0), 2, gen)
    top2 = softmax[:2] / softmax[:2].sum()
    assert proposal_probability(sparse, logits, Warp(1.0)) == pytest.approx(float(top2[sparse.token_id]))


@pytest.mark.parametrize("warp", [Warp(0.7, top_k=1), Warp(1.0, min_p=1.0)], ids=["top-k-1", "min-p-1"])
@pytest.mark.parametrize("top_n", [0, 2])
def test_a_token_of_a_warp_that_keeps_one_is_rated_by_the_draft_s_softmax(warp: Warp, top_n: int) -> None:
    """top_k 1 or min_p 1 keeps one token wherever it samples: greedy decoding in effect, each token
    drawn with probability 1 whatever the draft believes; the confidence stops read the draft's
    softmax, as for a greedy token (before, 1: no block of such a request ever stopped, and each
    ran to its K). A warp that leaves one token at some positions only (a top_p below the most
    likely token's share there) is rated by the distribution drawn from, as any sampled token."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    sample = sample_draft_token(logits, warp, top_n, torch.Generator().manual_seed(0))
    assert sample.token_id == 0 and sample.probs is not None and warp.keeps_one
    assert proposal_probability(sample, logits, warp) == pytest.approx(float(torch.softmax(logits, -1)[0]))
    narrow = Warp(1.0, top_p=0.3)
    assert not narrow.keeps_one
    alone = sample_draft_token(logits, narrow, top_n, torch.Generator().manual_seed(0))
    assert (alone.token_id, proposal_probability(alone, logits, narrow)) == (0, 1.0)


def test_position_generator_is_deterministic_and_role_separated() -> None:
    a = torch.rand(4, generator=position_generator(7, 10, "target"))
    b = torch.rand(4, generator=position_generator(7, 10, "target"))
    c = torch.rand(4, generator=position_generator(7, 10, "draft"))
    d = torch.rand(4, generator=position_generator(7, 11, "target"))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_proposal_matrix_kinds() -> None:
    samples = [
        DraftSample(token_id=2),
        DraftSample(token_id=1, ids=torch.tensor([1, 4]), probs=torch.tensor([0.25, 0.75])),
        DraftSample(token_id=0, probs=torch.full((V,), 0.2)),
    ]
    q = proposal_matrix(samples, V)
    assert q[0].tolist() == [0, 0, 1, 0, 0]
    assert q[1].tolist() == [0, 0.25, 0, 0, 0.75]
    assert torch.allclose(q[2], torch.full((V,), 0.2))


def _broken_sampler(target_logits, draft_tokens, draft_probs, warp, generator) -> Verdict:  # type: ignore[no-untyped-def]
    """Samples the recovered token from p instead of norm(max(0, p - q)): a classic bug."""
    p = warped_probs(target_logits, warp)
    k = draft_tokens.shape[0]
    for i in range(k):
        x = int(draft_tokens[i])
        if float(torch.rand(1, generator=generator)) * float(draft_probs[i, x]) >= float(p[i, x]):
            return Verdict(i, [*draft_tokens[:i].tolist(), int(torch.multinomial(p[i], 1, generator=generator))])
    return Verdict(k, [*draft_tokens.tolist(), int(torch.multinomial(p[k], 1, generator=generator))])


def sampled_sequences(
    target: LogitFn,
    draft: LogitFn,
    length: int,
    k: int,
    warp: Warp,
    top_n: int,
    n: int,
    sampler: Sampler = rejection_sample,
) -> collections.Counter[tuple[int, ...]]:
    """``n`` sequences after the prompt (0,), half of them in a forked process beside this one,
    each half with a generator of its own."""

    def sequences(which: range) -> collections.Counter[tuple[int, ...]]:
        gen = torch.Generator().manual_seed(1234 + which.start)
        return collections.Counter(
            speculative_sequence(target, draft, (0,), length, k, warp, top_n, gen, sampler) for _ in which
        )

    first, second = in_two_processes(sequences, n)
    samples = first + second
    assert samples.total() == n
    return samples


DIST_CASES = [
    pytest.param(Warp(1.0), 0, 2, id="dense-T1-k2"),
    pytest.param(Warp(0.8, top_k=3), 2, 3, id="sparse2-T0.8-topk3-k3"),
    pytest.param(Warp(1.2, top_p=0.8), 0, 1, id="dense-T1.2-topp0.8-k1"),
]


@pytest.mark.alone
@pytest.mark.parametrize(("warp", "top_n", "k"), DIST_CASES)
def test_speculative_sampling_follows_target_distribution(warp: Warp, top_n: int, k: int) -> None:
    vocab, length, n = 4, 3, 20_000
    target = random_logit_table(vocab, 1.5, seed=11)
    draft = random_logit_table(vocab, 1.5, seed=12)
    exact = exact_distribution(target, (0,), length, vocab, warp)
    samples = sampled_sequences(target, draft, length, k, warp, top_n, n)
    assert chi_square_pvalue(samples, exact, n) > PASS_P


@pytest.mark.alone
def test_distribution_test_catches_a_broken_sampler() -> None:
    vocab, length, n, warp = 4, 3, 20_000, Warp(1.0)
    target = random_logit_table(vocab, 1.5, seed=11)
    draft = random_logit_table(vocab, 1.5, seed=12)
    exact = exact_distribution(target, (0,), length, vocab, warp)
    samples = sampled_sequences(target, draft, length, 2, warp, 0, n, sampler=_broken_sampler)
    assert chi_square_pvalue(samples, exact, n) < PLANTED_P


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 1.0, 1e6, 3.4e38])
def test_warping_never_overflows(temperature: float) -> None:
    """Large logits at a small temperature, or any temperature up to float32's max: finite probabilities."""
    logits = torch.tensor([[1e4, -1e4, 0.0, 9999.0, -math.inf]])
    for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 1e-45), (3, 0.99999994)):
        p = warped_probs(logits, Warp(temperature, top_k, top_p))
        assert bool(torch.isfinite(p).all()) and float(p.sum()) == pytest.approx(1.0)
        assert float(p[0, 4]) == 0.0


def test_temperatures_below_the_epsilon_are_greedy() -> None:
    assert Warp(9.99e-6).greedy and Warp(0.0).greedy and Warp(1e-40).greedy and not Warp(1e-5).greedy
    logits = torch.tensor([0.5, 3.0, 2.9])
    assert warped_probs(logits, Warp(1e-30)).tolist() == [0.0, 1.0, 0.0]


def test_non_finite_logits_are_an_error_of_the_request() -> None:
    from specdec.serving.errors import NumericalError

    for bad in (math.nan, math.inf):
        logits = torch.tensor([[0.0, bad, 1.0], [0.0, 0.0, 0.0]])
        with pytest.raises(NumericalError):
            warped_probs(logits, Warp(1.0))
        with pytest.raises(NumericalError):
            rejection_sample(logits, torch.tensor([1]), torch.tensor([[0.0, 1.0, 0.0]]), Warp(1.0), None)
    with pytest.raises(NumericalError):
        rejection_sample(torch.tensor([[0.0, math.nan], [0.0, 0.0]]), torch.tensor([1]), None, Warp(), None)
