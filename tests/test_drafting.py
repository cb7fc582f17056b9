"""Other ways to draft, end to end over real processes: n-gram lookup (with and without a draft
model), the hybrid of lookup and model, an early-exit draft cut from the target's checkpoint and an
int8 draft (its one-token steps lean).
Greedy output equals HF ``generate`` on the target alone for every method; sampled output follows
the target's exact distribution with the reply index, the early-exit draft and guessing ahead."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from specdec.runtime.output_vocab import write_output_vocab
from specdec.tools.launch import LocalCluster, worker_info
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import metric
from tests.conftest import CLUSTER_COORDINATOR_ARGS, CLUSTER_WORKER_ARGS
from tests.helpers import draft_vocab_file
from tests.reference import coordinator_stub, make_request, reference_greedy, seeded_replies
from tests.spec_oracle import PASS_P, Enumerator, chi_square_pvalue, rejects
from tests.tiny_models import TinyModels, build_on_int4_grid

# The bigram target's greedy output cycles within a few dozen tokens (lookup drafts then match).
PROMPTS = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 130, 64, 11, 250, 0]]
MAX_NEW = 40
METHODS = {
    "model": coordinator_pb2.DRAFT_METHOD_MODEL,
    "ngram": coordinator_pb2.DRAFT_METHOD_NGRAM,
    "hybrid": coordinator_pb2.DRAFT_METHOD_HYBRID,
}


def _start(workdir: Path, target: Path, draft: Path | None, draft_args: list[str]) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        str(target), str(draft) if draft else None, workdir, worker_args=CLUSTER_WORKER_ARGS,
        draft_args=draft_args, coordinator_args=CLUSTER_COORDINATOR_ARGS, startup_timeout_s=120,
    )  # fmt: skip
    with cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster_lookup(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """A target worker and a coordinator: no draft model at all."""
    yield from _start(tmp_path_factory.mktemp("lookup"), tiny_models.bigram, None, [])


@pytest.fixture(scope="module")
def cluster_early_exit(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """The draft worker loads the target's own checkpoint and keeps its first layer."""
    yield from _start(tmp_path_factory.mktemp("early-exit"), tiny_models.bigram, tiny_models.bigram,
                      ["--draft-layers", "1"])  # fmt: skip


@pytest.fixture(scope="module")
def cluster_draft_vocab(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """A draft worker whose model scores only the even token ids (``--draft-vocab``)."""
    workdir = tmp_path_factory.mktemp("draft-vocab")
    vocab = draft_vocab_file(workdir / "even.json", tiny_models.noisy)
    yield from _start(workdir, tiny_models.target, tiny_models.noisy, ["--draft-vocab", str(vocab)])


@pytest.fixture(scope="module")
def cluster_guessing(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """The bigram target and itself as the draft, whose output repeats what the session holds:
    the draft worker's guesses ahead (on by default) are drawn."""
    yield from _start(tmp_path_factory.mktemp("guessing"), tiny_models.bigram, tiny_models.bigram, [])


@pytest.fixture(scope="module", params=["int8", "int4"])
def cluster_quantized(request: pytest.FixtureRequest, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """A copy of the target as the draft, quantized (``--quantize int8``, as the benchmark's CPU
    draft, or ``int4``): its one-token steps run the lean step. For int4 the target is the tiny
    target on int4's grid (build_on_int4_grid), as the benchmark's checkpoints nearly are."""
    workdir = request.getfixturevalue("tmp_path_factory").mktemp(request.param)
    target = tiny_models.target if request.param == "int8" else build_on_int4_grid(tiny_models.target, workdir / "grid")
    yield from _start(workdir, target, target, ["--quantize", request.param])


REPLY_INDEX_TOKENS = 4096
CALLERS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}


@pytest.fixture(scope="module")
def cluster_replies(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """No draft model; lookups also match earlier replies (the reply index); two callers with tokens."""
    workdir = tmp_path_factory.mktemp("replies")
    tokens = workdir / "tokens"
    tokens.write_text("".join(f"{who}:{token}\n" for who, token in CALLERS.items()))
    cluster = LocalCluster(
        str(tiny_models.target), None, workdir, worker_args=CLUSTER_WORKER_ARGS, startup_timeout_s=120,
        coordinator_args=[*CLUSTER_COORDINATOR_ARGS, "--reply-index-tokens", str(REPLY_INDEX_TOKENS),
                          "--auth-tokens-file", str(tokens)],
    )  # fmt: skip
    with cluster:
        yield cluster


def request(
    prompt: list[int], method: str | None = None, k: int = 4, fixed: bool = True
) -> coordinator_pb2.GenerateRequest:
    req = make_request(prompt, k=k, max_new=MAX_NEW, fixed=fixed, ignore_eos=True)
    if method is not None:
        req.speculation.method = METHODS[method]
    return req


def generate(cluster: LocalCluster, req: coordinator_pb2.GenerateRequest) -> coordinator_pb2.GenerateResponse:
    for client in coordinator_stub(cluster):
        return client.Generate(req)
    raise AssertionError("no stub")


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_a_service_without_a_draft_model_speculates_by_lookup(
    cluster_lookup: LocalCluster, tiny_models: TinyModels, prompt: list[int], fixed: bool
) -> None:
    reply = generate(cluster_lookup, request(prompt, fixed=fixed))
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.bigram), tuple(prompt), MAX_NEW, True)
    s = reply.stats
    assert s.lookup_rounds > 0 and s.lookup_tokens_accepted > 0
    assert s.draft_tokens_proposed == s.lookup_tokens_proposed  # every draft came from the lookup
    assert s.rounds < MAX_NEW  # lookups saved target passes
    assert sum(s.proposed_by_position) == s.draft_tokens_proposed and len(s.proposed_by_position) <= 8
    assert sum(s.accepted_by_position) == s.draft_tokens_accepted
    accepted = list(s.accepted_by_position)
    assert accepted == sorted(accepted, reverse=True)  # a draft is accepted only after the ones before it
    if fixed:
        assert s.lookup_tokens_accepted / s.lookup_tokens_proposed > 0.5


def test_info_and_metrics_name_the_lookup_drafts(cluster_lookup: LocalCluster) -> None:
    with grpc.insecure_channel(cluster_lookup.address) as channel:
        info = coordinator_pb2_grpc.GenerationStub(channel).GetInfo(coordinator_pb2.GetInfoRequest())
    assert list(info.draft_methods) == ["ngram"] and info.default_draft_method == "ngram"
    assert info.lookup_max_tokens == 8
    before = metric(cluster_lookup, "coordinator", "specdec_proposer_rounds_total", 'proposer="ngram"')
    reply = generate(cluster_lookup, request(PROMPTS[0], method="model"))  # no model here: lookup instead
    after = metric(cluster_lookup, "coordinator", "specdec_proposer_rounds_total", 'proposer="ngram"')
    assert after - before == reply.stats.lookup_rounds > 0


@pytest.mark.parametrize("method", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_early_exit_draft_and_every_method_give_the_target_s_tokens(
    cluster_early_exit: LocalCluster, tiny_models: TinyModels, prompt: list[int], method: str
) -> None:
    reply = generate(cluster_early_exit, request(prompt, method))
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.bigram), tuple(prompt), MAX_NEW, True)
    s = reply.stats
    model_rounds = s.rounds - s.target_only_rounds - s.lookup_rounds
    if method == "model":
        assert s.lookup_rounds == 0 and model_rounds >= s.rounds - 1  # the last round may have no budget
    elif method == "ngram":
        assert model_rounds == 0 and s.lookup_rounds > 0
    else:  # lookup where the suffix matches (fixed K: whenever it does), the model elsewhere
        assert s.lookup_rounds > 0 and model_rounds > 0


def test_early_exit_draft_reports_its_layers(cluster_early_exit: LocalCluster, tiny_models: TinyModels) -> None:
    info = worker_info(cluster_early_exit.processes["draft"].address, "draft")
    assert info.model_id == f"{tiny_models.bigram} (first 1 layers)"
    with grpc.insecure_channel(cluster_early_exit.address) as channel:
        served = coordinator_pb2_grpc.GenerationStub(channel).GetInfo(coordinator_pb2.GetInfoRequest())
    assert list(served.draft_methods) == ["model", "ngram", "hybrid"] and served.default_draft_method == "hybrid"


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "adaptive"])
def test_a_draft_that_guesses_ahead_gives_the_target_s_tokens_in_fewer_passes(
    cluster_guessing: LocalCluster, tiny_models: TinyModels, fixed: bool
) -> None:
    """The draft worker's default --guess-tokens 8 with a draft whose output repeats the
    session's tokens: its guesses are drawn and their passes saved (its metrics say how many);
    the tokens are the target's, with fixed K = 8 and adaptive K."""

    def draft_metric(name: str) -> float:
        return metric(cluster_guessing, "draft", name)

    before = {name: draft_metric(name) for name in GUESS_METRICS}
    reply = generate(cluster_guessing, request(PROMPTS[1], "model", k=8, fixed=fixed))
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.bigram), tuple(PROMPTS[1]), MAX_NEW, True)
    taken, guessed, computed = (draft_metric(name) - before[name] for name in GUESS_METRICS)
    assert taken > 0 and reply.stats.draft_tokens_accepted > 0
    assert guessed >= taken and computed > 0


GUESS_METRICS = (
    "specdec_draft_guesses_taken_total", "specdec_draft_guessed_tokens_total", "specdec_worker_computed_tokens_total",
)  # fmt: skip


def test_adaptive_hybrid_is_exact_and_uses_the_lookup(
    cluster_early_exit: LocalCluster, tiny_models: TinyModels
) -> None:
    reply = generate(cluster_early_exit, request(PROMPTS[1], "hybrid", fixed=False))
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.bigram), tuple(PROMPTS[1]), MAX_NEW, True)
    assert reply.stats.lookup_tokens_accepted > 0


@pytest.mark.parametrize("method", ["ngram", "hybrid"])
@pytest.mark.parametrize("k", [1, 4])
def test_lookup_methods_with_pipelining_are_exact(
    cluster_pipelined: LocalCluster, tiny_models: TinyModels, method: str, k: int
) -> None:
    """Lookup rounds between pipelined model rounds: a block drafted ahead is never used after
    the session moved on without it."""
    prompt = [9, 8, 7, 9, 8, 7, 9, 8]  # repeats: the lookup matches at once
    reply = generate(cluster_pipelined, request(prompt, method, k=k))
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(prompt), MAX_NEW, True)
    assert reply.stats.lookup_rounds > 0


def test_a_reply_given_before_is_drafted_from_the_reply_index(
    cluster_replies: LocalCluster, tiny_models: TinyModels
) -> None:
    """The same prompt again (a new one-shot request) is drafted the earlier reply from its first
    token, only for the caller who got it; the tokens are the target's either way. (Adaptive K:
    `fixed` K drafts from the session's own tokens only, see the next test.)"""
    prompt, fixed = [33, 150, 8, 61, 2], False  # a prompt of its own: the index is the cluster's
    expected = reference_greedy(str(tiny_models.target), tuple(prompt), MAX_NEW, True)
    before = metric(cluster_replies, "coordinator", "specdec_reply_lookup_rounds_total")
    with grpc.insecure_channel(cluster_replies.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)

        def generate_as(who: str) -> coordinator_pb2.GenerateResponse:
            reply = stub.Generate(
                request(prompt, "ngram", fixed=fixed), metadata=[("authorization", f"Bearer {CALLERS[who]}")]
            )
            assert list(reply.token_ids) == expected
            return reply

        first, again, other = generate_as("alice"), generate_as("alice"), generate_as("bob")
        info = stub.GetInfo(coordinator_pb2.GetInfoRequest(), metadata=[("authorization", f"Bearer {CALLERS['bob']}")])
    assert first.stats.reply_lookup_rounds == 0 and other.stats.reply_lookup_rounds == 0  # nothing of theirs yet
    s = again.stats
    assert s.reply_lookup_rounds > 0 and s.reply_lookup_tokens_accepted >= MAX_NEW // 2
    assert s.reply_lookup_tokens_accepted <= s.lookup_tokens_accepted and s.reply_lookup_rounds <= s.lookup_rounds
    assert s.rounds < first.stats.rounds and s.rounds < other.stats.rounds
    assert info.reply_index_tokens == REPLY_INDEX_TOKENS
    after = metric(cluster_replies, "coordinator", "specdec_reply_lookup_rounds_total")
    assert after - before == s.reply_lookup_rounds
    assert metric(cluster_replies, "coordinator", "specdec_reply_index_tokens") >= 3 * MAX_NEW


def test_a_seeded_request_replays_with_the_reply_index_on(cluster_replies: LocalCluster) -> None:
    """The same seed, prompt and `fixed` K give the same sampled tokens (README, Seeds), also once
    the reply index holds the first reply: what other requests replied must not change a replay."""
    prompt = [77, 3, 190, 45, 12]
    seeded = request(prompt, "ngram")
    seeded.sampling.temperature, seeded.sampling.seed = 1.0, 4321
    metadata = [("authorization", f"Bearer {CALLERS['alice']}")]
    with grpc.insecure_channel(cluster_replies.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        replies = [stub.Generate(seeded, metadata=metadata) for _ in range(4)]
    assert [list(r.token_ids) for r in replies[1:]] == [list(replies[0].token_ids)] * 3
    assert all(r.stats.reply_lookup_rounds == 0 for r in replies)


def test_the_reply_index_is_off_by_default(cluster_lookup: LocalCluster, tiny_models: TinyModels) -> None:
    prompt = [44, 12, 250, 9]
    first, again = generate(cluster_lookup, request(prompt)), generate(cluster_lookup, request(prompt))
    assert list(again.token_ids) == list(first.token_ids)
    assert again.stats.reply_lookup_rounds == 0
    with grpc.insecure_channel(cluster_lookup.address) as channel:
        info = coordinator_pb2_grpc.GenerationStub(channel).GetInfo(coordinator_pb2.GetInfoRequest())
    assert info.reply_index_tokens == 0


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_a_draft_with_a_draft_vocabulary_gives_the_target_s_tokens(
    cluster_draft_vocab: LocalCluster, tiny_models: TinyModels, prompt: list[int], fixed: bool
) -> None:
    reply = generate(cluster_draft_vocab, request(prompt, "model", fixed=fixed))
    expected = reference_greedy(str(tiny_models.target), tuple(prompt), MAX_NEW, True)
    assert list(reply.token_ids) == expected
    assert any(token % 2 for token in expected)  # tokens the draft cannot propose: the target's own
    if fixed:  # adaptive K may turn speculation off where the measured costs say it does not pay (a loaded host)
        assert reply.stats.draft_tokens_accepted > 0


def test_a_draft_vocabulary_of_another_tokenizer_stops_start_up(tmp_path: Path, tiny_models: TinyModels) -> None:
    from specdec.tools.launch import LaunchError, spawn

    vocab = tmp_path / "v.json"
    write_output_vocab(vocab, [1, 2], "another tokenizer", 259, "test")
    process = spawn("draft", ["--model", str(tiny_models.noisy), "--draft-vocab", str(vocab), *CLUSTER_WORKER_ARGS],
                    tmp_path)  # fmt: skip
    try:
        with pytest.raises(LaunchError, match="made for another tokenizer"):
            process.wait_ready(60)
    finally:
        process.stop()


def test_a_bad_draft_layer_count_stops_start_up(tmp_path: Path, tiny_models: TinyModels) -> None:
    from specdec.tools.launch import LaunchError, spawn

    args = ["--model", str(tiny_models.bigram), "--draft-layers", "2", *CLUSTER_WORKER_ARGS]
    process = spawn("draft", args, tmp_path)
    try:
        with pytest.raises(LaunchError, match="--draft-layers must be between 1 and 1"):
            process.wait_ready(60)
    finally:
        process.stop()


# Sampled requests through each kind of draft: (cluster, target, method)
SAMPLED = {
    "reply-index": ("cluster_replies", "target", "ngram"),
    "early-exit": ("cluster_early_exit", "bigram", "model"),
    "guessing-ahead": ("cluster_guessing", "bigram", "model"),
}
SAMPLES = 1500  # seeded requests


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SAMPLED))
def test_sampled_replies_follow_the_target_distribution(
    kind: str, tiny_models: TinyModels, request: pytest.FixtureRequest
) -> None:
    """Through the whole service, one prompt sent SAMPLES times with other seeds (adaptive K,
    temperature 0.4, top-k 4, 8 new tokens): the first three tokens follow the target's exact
    distribution (chi-square against an enumeration with plain forward passes) and reject that at
    temperature 1 (the power check). With the reply index the earlier requests' sampled replies
    are proposed one-hot to the later ones (about 6,000 such rounds a run here); the early-exit
    draft (about one token in six accepted) and the draft that guesses ahead (its guesses saved a
    few dozen steps a run) propose from their own distributions. Every kind's drafts are both
    accepted and rejected. Planted in the target worker by hand, a residual drawn from p after a
    rejection failed the reply-index case (p = 3e-29) and passed the other two: that bug moves the
    distribution by about how often the draft is right where it is not certain, and this early-exit
    draft is seldom right, the guessing one (the target itself) nearly always (the worker jobs'
    chi-square tests in tests/test_exactness_production.py catch it with drafts between)."""
    fixture, target, method = SAMPLED[kind]
    cluster: LocalCluster = request.getfixturevalue(fixture)
    enumerator = Enumerator(str(getattr(tiny_models, target)), 3)
    prompt = [61, 8, 150, 33]
    asked = make_request(prompt, k=4, max_new=8, fixed=False, ignore_eos=True, temperature=0.4, top_k=4)
    asked.speculation.method = METHODS[method]
    metadata = (("authorization", f"Bearer {CALLERS['alice']}"),) if kind == "reply-index" else ()
    guesses_before = metric(cluster, "draft", GUESS_METRICS[0]) if kind == "guessing-ahead" else 0.0
    replies = seeded_replies(cluster.address, asked, SAMPLES, metadata)
    if kind == "guessing-ahead":  # the draft's guesses saved some of its steps
        assert metric(cluster, "draft", GUESS_METRICS[0]) > guesses_before
    counts = collections.Counter(tuple(reply.token_ids[:3]) for reply in replies)
    proposed = sum(reply.stats.draft_tokens_proposed for reply in replies)
    accepted = sum(reply.stats.draft_tokens_accepted for reply in replies)
    assert 0 < accepted < proposed
    assert kind != "reply-index" or sum(reply.stats.reply_lookup_rounds for reply in replies) > 0
    assert chi_square_pvalue(counts, enumerator.distribution(tuple(prompt), asked.sampling), SAMPLES) > PASS_P
    assert rejects(counts, enumerator.distribution(tuple(prompt), asked.sampling, "the temperature ignored"))


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_a_quantized_draft_s_lean_steps_give_the_target_s_tokens_and_propose_its_own(
    cluster_quantized: LocalCluster, prompt: list[int], fixed: bool
) -> None:
    """The draft worker's production path with an int8 or int4 draft: its start-up log says the
    lean step is on, the reply is the target's greedy tokens, and with fixed K a copy of the
    target has at least half its drafts accepted over rounds cut back after rejections (int8
    rounding flips the tiny models' near ties: 27/33 to 30/39 here, the same counts as the model's
    own forward with the lean step off; int4 of the tiny target's random weights flipped more,
    19/81 and 24/61, and of those weights on int4's grid 31/35 and 30/36). Planted in the lean
    step, each failed it (int8): the position one too far (16/49 to 20/75 accepted), keys left
    unrotated (5/130, 7/122), attention to the new key only (1/146, 2/142)."""
    log = cluster_quantized.processes["draft"].log_file.read_text().splitlines()
    assert [line["on"] for line in map(json.loads, log) if line["event"] == "lean_step"] == [True]
    reply = generate(cluster_quantized, request(prompt, "model", fixed=fixed))
    assert list(reply.token_ids) == reference_greedy(cluster_quantized.target_model, tuple(prompt), MAX_NEW, True)
    if fixed:  # adaptive K may turn speculation off where the measured costs say it does not pay (a loaded host)
        assert reply.stats.draft_tokens_accepted >= reply.stats.draft_tokens_proposed / 2, reply.stats
