"""Sampling math: logit warping, draft proposals and rejection sampling.

Pure functions over tensors: no model, RPC or I/O here. Notation follows Leviathan et al.
(2022) / Chen et al. (2023): ``p`` is the target distribution, ``q`` the draft (proposal)
distribution, both AFTER the same temperature / top-k / top-p warping. A draft token ``x`` is
*accepted* with probability ``min(1, p(x) / q(x))``; at the first rejection a *recovered* token is
drawn from ``norm(max(0, p - q))``; when all ``k`` drafts are accepted a *bonus* token is drawn
from the target distribution at the next position.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.serving.errors import NumericalError

Tensor = torch.Tensor

# Temperatures below this decode greedily (as vLLM does): dividing logits by a smaller number
# overflows float32 and the limit T -> 0 of the warped distribution is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Warp:
    """Temperature / top-k / top-p / min-p warping; a temperature below GREEDY_TEMPERATURE (0
    included) means greedy decoding (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def keeps_one(self) -> bool:
        """Whether a sampled draw keeps only the most likely token (ties aside): top_k 1 or min_p 1."""
        return self.top_k == 1 or self.min_p == 1.0


def warped_probs(logits: Tensor, warp: Warp) -> Tensor:
    """Probabilities after temperature, top-k, top-p, then min-p (the order HF uses).

    ``logits``: [..., V] -> float32 [..., V] summing to 1 over the last dim. Greedy warps give the
    one-hot distribution of the argmax (the limit temperature -> 0).

    The logits are shifted so that their maximum is 0 before dividing by the temperature (the
    softmax, top-k and top-p do not change), so no finite logits overflow at any temperature.
    Logits that are NaN or +inf raise NumericalError: an error of this request, not of the process
    (the row's maximum is NaN where any logit is: it propagates NaN).
    """
    scores, ids = _warped_scores(logits, warp)
    if ids is None:
        return scores.softmax(-1)
    probs = torch.zeros(scores.shape[:-1] + logits.shape[-1:], device=scores.device)
    return probs.scatter(-1, ids, scores.softmax(-1))


def _warped_scores(logits: Tensor, warp: Warp, widths: Sequence[int] = ()) -> tuple[Tensor, Tensor | None]:
    """``warped_probs`` before its softmax: ``(scores, None)``, the whole row's [..., V] (-inf
    where the warp drops an id), or ``(scores, ids)`` [..., n] in descending order where only
    ``ids`` can have mass. Top-p looks for its cut among the ``widths`` most likely ids in turn,
    then among the TOP_P_CANDIDATES most likely, then in the whole row. Greedy: the argmax alone."""
    logits = logits.float()
    top = logits.max(-1, keepdim=True).values
    if not bool(torch.isfinite(top).all()):
        raise NumericalError("the model produced non-finite logits for this request; nothing was sampled")
    if warp.greedy:
        return torch.zeros_like(top), logits.argmax(-1, keepdim=True)
    scores = torch.sub(logits, top).div_(warp.temperature)  # the most likely id's score is 0
    vocab = scores.shape[-1]
    if 0 < warp.top_k <= TOP_P_CANDIDATES and warp.top_k < vocab:
        # top-p and min-p see only the k ids top-k keeps: applied to those k scores alone (5 rows
        # of 151,936 ids, top-k 40, top-p 0.95, min-p 0.05, on the 2-core host: 9.8 ms against 21
        # ms masking whole rows), unless ids tie the k-th score (top-k then keeps more than k)
        values, ids = torch.topk(scores, warp.top_k, dim=-1)
        if not bool(((scores >= values[..., -1:]).sum(-1) > warp.top_k).any()):
            if warp.top_p < 1.0:  # the k scores are in descending order: top-p keeps a prefix of them
                values = values.masked_fill(~_top_p_keep(values.softmax(-1), warp.top_p)[0], -math.inf)
            return _min_p_masked(values, warp.min_p), ids
    if warp.top_k and warp.top_k < vocab:
        kth = torch.topk(scores, warp.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if warp.top_p < 1.0:
        total = scores.logsumexp(-1, keepdim=True)
        for width in sorted({min(w, vocab) for w in (*widths, TOP_P_CANDIDATES) if w <= TOP_P_CANDIDATES}):
            values, ids = torch.topk(scores, width, dim=-1)  # descending
            keep, within = _top_p_keep((values - total).exp(), warp.top_p)
            if width == vocab or bool(within.all()):  # every row's cut among them
                return _min_p_masked(values.masked_fill(~keep, -math.inf), warp.min_p), ids
        drop = _top_p_drop(scores.softmax(-1), ids, keep, within, warp.top_p)
        scores = scores.masked_fill(drop, -math.inf)
    return _min_p_masked(scores, warp.min_p), None


# top-p looks for its cut among the most likely tokens first, and only in a row where they hold
# less than the top-p mass, in the whole row (``_wide_top_p_drop``): on the 2-core CPU host sorting
# a 151,936-id row took 12-17 ms and a top-1024 ~1 ms. Over 1,200 positions of code and prose,
# Qwen2.5-Coder-0.5B's top_p 0.9-0.95 mass lay within its top 1024 at 99.5-99.9% of them at
# temperature 0.7-0.8, 87-97% at 1.0. Where every row's cut lies there, the probabilities are
# computed over those ids alone (``_warped_scores``): the row's softmaxes and masks are left
# out, but for one logsumexp (a K = 4 block of real Qwen2.5-Coder-0.5B rows, temperature 0.7,
# top-p 0.9, min-p 0.05, 2 threads on the 2-core host: 35.5 ms -> 18.0 ms for the draft's four
# warps and draws and the target's rejection sampling of five rows).
TOP_P_CANDIDATES = 1024


def _min_p_masked(scores: Tensor, min_p: float) -> Tensor:
    """``scores`` (whose maximum is 0) without the ids min-p removes: those whose probability is
    below ``min_p`` times the most likely's, that is whose score is below log(min_p). The most
    likely id always stays; min_p 0 removes none."""
    return scores.masked_fill(scores < math.log(min_p), -math.inf) if min_p > 0 else scores


def _top_p_keep(top: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """Of the candidates whose probabilities are ``top`` [..., n] (descending), those top-p keeps:
    the ones whose more likely candidates hold less than ``top_p`` (summed in float64, so the cut
    depends on the probabilities alone, not on how a float32 running sum rounds); the first always.
    Also, per row, whether the candidates hold ``top_p`` (else the cut lies beyond them)."""
    mass = top.double().cumsum(-1)
    keep = (mass - top) < top_p
    keep[..., 0] = True
    return keep, mass[..., -1] >= top_p


def _top_p_drop(probs: Tensor, order: Tensor, keep: Tensor, within: Tensor, top_p: float) -> Tensor:
    """The ids top-p removes from ``probs`` [..., V], given its most likely ids ``order`` [..., n]
    (descending) and what ``_top_p_keep`` said of them: those whose more likely ids already hold
    ``top_p`` of the mass; the most likely id always stays. Equal to sorting the whole row: an id
    outside a candidate set that holds ``top_p`` has at least that mass before it. A row whose
    candidates hold less than ``top_p`` (a flat one) is cut by ``_wide_top_p_drop``."""
    vocab = probs.shape[-1]
    drop = torch.ones_like(probs, dtype=torch.bool).scatter(-1, order, ~keep)
    if order.shape[-1] < vocab:
        rows, flat = drop.view(-1, vocab), probs.reshape(-1, vocab)
        for row in (~within).view(-1).nonzero().flatten().tolist():
            rows[row] = _wide_top_p_drop(flat[row], top_p)
    return drop


def _wide_top_p_drop(probs: Tensor, top_p: float) -> Tensor:
    """``_top_p_drop`` of one row [V] without sorting it: the cut is the probability ``v`` whose
    ids and the more likely ones hold at least ``top_p`` while the more likely alone hold less. The
    bit patterns of non-negative float32 numbers order as the numbers do, so two histograms of
    the row's mass (float64) find ``v``: by the patterns' upper 16 bits, then by the lower 16 bits
    within the upper half's bin that the cut falls in. The ids above ``v`` stay; of the ids equal
    to ``v``, those whose mass before them (the ids above, then the equal ones in id order) is
    below ``top_p``. A flat row of 151,936 ids: ~6 ms on the 2-core host (one thread), where
    selecting the row's top 8,192, 65,536 and then all of its ids in turn took ~34 ms (all of
    them alone ~20 ms). The masses are summed in another order than a sort's: a cut can differ
    only for ids within float64 rounding of ``top_p``."""
    values = probs.float().contiguous()
    bits = values.view(torch.int32).long()
    weights = values.double()
    upper = bits >> 16
    # the masses of each bin and those above it: not increasing, so the bins that reach top_p come first
    above = torch.bincount(upper, weights=weights, minlength=1 << 16).flip(0).cumsum(0).flip(0)
    bin_ = int((above >= top_p).sum()) - 1
    if bin_ < 0:  # the whole row holds less than top_p (rounding): nothing is cut
        return torch.zeros_like(values, dtype=torch.bool)
    before = float(above[bin_ + 1]) if bin_ + 1 < above.numel() else 0.0  # the mass of the bins above
    inside = (upper == bin_).nonzero().flatten()
    lower = bits[inside] & 0xFFFF
    below = torch.bincount(lower, weights=weights[inside], minlength=1 << 16).flip(0).cumsum(0).flip(0) + before
    cut = int((below >= top_p).sum()) - 1
    if cut < 0:  # no bin within reached it (rounding): the bin's least
        cut = int(lower.min())
    more = float(below[cut + 1]) if cut + 1 < below.numel() else before  # the mass above the cut
    pattern = (bin_ << 16) | cut
    drop = bits < pattern
    equal = inside[lower == cut]
    value = float(values[equal[0]])
    kept = equal.numel() if value == 0 else min(equal.numel(), max(0, math.ceil((top_p - more) / value)))
    drop[equal[kept:]] = True
    return drop


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """An index of ``probs`` [V] (non-negative, any positive total) drawn with probability
    ``probs[i] / probs.sum()``: one uniform from ``generator`` and a search of the cumulative
    sums (float64, so that no id's share is lost to rounding). ``torch.multinomial`` draws V
    exponentials instead: 5.3 ms for a 151,936-id row on the 2-core host against 0.3 ms here."""
    cumulative = probs.double().cumsum(-1)
    total = float(cumulative[-1])
    if not (math.isfinite(total) and total > 0):
        raise NumericalError("the distribution to sample from has no positive finite mass; nothing was sampled")
    uniform = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device)
    index = int(torch.searchsorted(cumulative, uniform * total, right=True))
    if index >= probs.shape[-1]:  # the uniform rounded to the total: the last id with mass
        index = int(torch.nonzero(probs > 0).max())
    return index


def position_generator(seed: int, position: int, role: str, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of every random draw for the token at absolute ``position`` (the number of
    tokens before it in the session), derived from the request seed, that position and the role
    (``draft`` or ``target``).

    Keying each draw to its position (instead of carrying generator state) makes it a function of
    where it happens alone: retries, re-prefills, worker restarts, failover to another replica and
    blocks drafted ahead replay the same draws, and draft and target use independent streams.
    """
    material = f"{seed}:{position}:{role}".encode()
    derived = int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little") >> 1
    generator = torch.Generator(device=device)
    generator.manual_seed(derived)
    return generator


@dataclass(frozen=True)
class DraftSample:
    """One draft token and the proposal distribution it was sampled from.

    ``ids is None and probs is None``: one-hot (greedy draft). ``ids`` set: sparse renormalised
    top-n distribution over ``ids``. Only ``probs`` set: dense distribution over the vocabulary.
    """

    token_id: int
    ids: Tensor | None = None
    probs: Tensor | None = None


def sample_draft_token(logits: Tensor, warp: Warp, top_n: int, generator: torch.Generator | None) -> DraftSample:
    """Draws a draft token from the warped draft distribution, exactly as it is reported.

    ``logits``: [V]. ``top_n > 0`` restricts the proposal to the ``top_n`` most likely tokens,
    renormalised, and samples from that restricted distribution (still exact: the target sees the
    very distribution the token came from). ``top_n == 0`` proposes the dense distribution.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be [V], got shape {tuple(logits.shape)}")
    if warp.greedy:
        return DraftSample(token_id=int(logits.argmax()))
    vocab = logits.shape[-1]
    if not 0 < top_n < vocab:
        q = warped_probs(logits, warp)
        return DraftSample(token_id=draw(q, generator), probs=q)
    # the top-n of the warped distribution are its n best scores, and their renormalised
    # probabilities those scores' softmax: no row of probabilities is made
    scores, ids = _warped_scores(logits, warp, (top_n,))
    if ids is None:
        scores, ids = torch.topk(scores, top_n)
    probs = scores[:top_n].softmax(-1)
    ids = ids[:top_n]
    return DraftSample(token_id=int(ids[draw(probs, generator)]), ids=ids, probs=probs)


def proposal_probability(sample: DraftSample, logits: Tensor, warp: Warp) -> float:
    """The probability of ``sample``'s token in the distribution it was drawn from; for a greedy
    (one-hot) sample, in the draft's own softmax of ``logits`` [V] (its belief in the token).

    So too for a sample of a warp that keeps one token wherever it samples (``Warp.keeps_one``):
    that is greedy decoding in effect, each token drawn with probability 1 whatever the draft
    believes, and kept where the target's argmax is the same token, of which the draft's softmax
    is its estimate, as in greedy decoding."""
    if sample.probs is None or warp.keeps_one:
        return float(torch.softmax(logits.float(), dim=-1)[sample.token_id])
    if sample.ids is None:
        return float(sample.probs[sample.token_id])
    return float(sample.probs[sample.ids == sample.token_id].sum())


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying a block: ``token_ids`` = accepted drafts + one recovered/bonus token."""

    num_accepted: int
    token_ids: list[int]


def rejection_sample(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    warp: Warp,
    generator: torch.Generator | Sequence[torch.Generator] | None,
) -> Verdict:
    """Speculative rejection sampling over one block.

    ``target_logits``: [k+1, V], row i scores the token after the prefix + the first i drafts.
    ``draft_tokens``: [k] int. ``draft_probs``: [k, V] proposal rows the drafts were sampled
    from (ignored when greedy; required otherwise). ``generator``: one for the whole block, or
    k+1 (row i's acceptance draw and its recovered/bonus token come from the i-th). The output
    follows the target distribution exactly for any proposal; greedy warps reduce to "accept
    while argmax p == x".
    """
    k = draft_tokens.shape[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [k+1, V] with k={k}, got {tuple(target_logits.shape)}")
    if warp.greedy:
        return _greedy_verdict(target_logits, draft_tokens)
    if draft_probs is None or draft_probs.shape != (k, target_logits.shape[1]):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {target_logits.shape[1]}] for sampled decoding")
    p = warped_probs(target_logits, warp)
    drafts = draft_tokens.long().to(p.device)
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, drafts]
    q_x = draft_probs.to(p.device).float()[rows, drafts]
    per_row = [generator] * (k + 1) if generator is None or isinstance(generator, torch.Generator) else generator
    if len(per_row) != k + 1:
        raise ValueError(f"rejection_sample needs k+1 = {k + 1} generators, got {len(per_row)}")
    draws = [torch.rand((), generator=g, device=p.device) for g in per_row[:k]]
    uniforms = torch.stack(draws) if draws else p_x.new_empty(0)
    # q(x) == 0 cannot happen for a token sampled from q: treat it as a bug and reject.
    accepted = (q_x > 0) & (uniforms * q_x < p_x)
    n = int(accepted.long().cumprod(0).sum())
    if n < k:
        residual = torch.clamp(p[n] - draft_probs[n].to(p.device).float(), min=0.0)
        dist = residual if float(residual.sum()) > 0 else p[n]
        last = draw(dist, per_row[n])
    else:
        last = draw(p[k], per_row[k])
    return Verdict(num_accepted=n, token_ids=[*drafts[:n].tolist(), last])


def _greedy_verdict(target_logits: Tensor, draft_tokens: Tensor) -> Verdict:
    if bool(torch.isnan(target_logits).any()):
        raise NumericalError("the model produced non-finite logits for this request; nothing was sampled")
    targets = target_logits.argmax(-1)
    k = draft_tokens.shape[0]
    matches = targets[:k] == draft_tokens.to(targets.device).long()
    n = int(matches.long().cumprod(0).sum())
    return Verdict(num_accepted=n, token_ids=targets[: n + 1].tolist())
