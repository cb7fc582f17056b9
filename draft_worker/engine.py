"""Drafting: autoregressive proposals from the small model, with the distributions they came from.

``propose_job`` drafts K tokens after a committed prefix. ``lookahead_job`` (pipelining) drafts
the block after one it already proposed, assuming that block is fully accepted and followed by
the draft's own guess of the target's next token. Each draft token is sampled with the generator
of its absolute position (specdec.runtime.sampling.position_generator), so a lookahead block that is used
is exactly the block a fresh request at that prefix would have produced.

``translated_propose_job`` is the same for a draft whose tokenizer differs from the target's
(specdec.runtime.vocab): it keeps the session's committed target ids and text beside the cache,
drafts in its own vocabulary and proposes in the target's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from specdec.runtime.kvcache import ResyncRequired, SessionCache, SessionCaches
from specdec.runtime.modeling import LoadedModel
from specdec.runtime.processing import NO_PROCESSING, Processing, process_logits
from specdec.runtime.sampling import DraftSample, Warp, position_generator, proposal_probability, sample_draft_token
from specdec.runtime.scheduler import ComputeMeter, Extend, Job
from specdec.runtime.tokens import common_prefix_len, prefix_hash
from specdec.runtime.vocab import TextMirror, VocabBridge
from specdec.serving.errors import InvalidRequest
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class DraftParams:
    """How to sample a block (shared by a stream's requests)."""

    k: int
    warp: Warp
    seed: int
    top_n: int
    vocab_limit: int = 0  # propose only ids below this (the target's vocabulary size); 0 = all
    processing: Processing = NO_PROCESSING  # the target's penalties / bias / min_tokens
    min_confidence: float = 0.0  # end the block after a token proposed with a lower probability
    min_block_confidence: float = 0.0  # end it once the product of its tokens' probabilities is lower


@dataclass(frozen=True)
class Block:
    """A drafted block.

    ``start``: committed length it was drafted after; ``assumed``: for a lookahead block, the tokens
    assumed between the previous block's start and ``start`` (empty otherwise). ``cache_len`` and
    ``cache_hash`` describe the draft's cache afterwards (it holds everything but the last draft).
    """

    samples: tuple[DraftSample, ...]
    start: int
    assumed: tuple[int, ...]
    cache_len: int
    cache_hash: int
    compute_ms: float
    ends_unsure: bool = False  # a confidence stop was reached at the last token

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.samples]


def _draft_block(
    entry: SessionCache,
    logits: torch.Tensor,
    params: DraftParams,
    start: int,
    device: torch.device,
    meter: ComputeMeter,
    shape: Callable[[SessionCache, torch.Tensor, DraftParams], torch.Tensor] | None = None,
) -> Generator[Extend, torch.Tensor, tuple[list[DraftSample], bool]]:
    """Samples up to ``params.k`` tokens starting from ``logits`` (the distribution after ``start``
    tokens); ``shape`` turns a position's logits into those sampled from (default: the target's
    processing). With ``params.min_confidence`` the block ends after the first token proposed with
    a lower probability; with ``params.min_block_confidence``, after the token that takes the
    product of the block's proposal probabilities (the draft's estimate of the chance that the
    target keeps the whole block) below it. The block's length then depends on the draft alone
    (never on the target), so every proposed token is verified as usual and the output
    distribution is unchanged. Returns the samples and whether a stop was reached at the last one."""
    shape = shape or _processed
    samples: list[DraftSample] = []
    unsure, block_probability = False, 1.0
    for i in range(params.k):
        generator = None if params.warp.greedy else position_generator(params.seed, start + i, "draft", device)
        shaped = shape(entry, logits, params)
        sample = sample_draft_token(shaped, params.warp, params.top_n, generator)
        samples.append(sample)
        if params.min_confidence > 0 or params.min_block_confidence > 0:
            probability = proposal_probability(sample, shaped)
            block_probability *= probability
            unsure = probability < params.min_confidence or block_probability < params.min_block_confidence
        if i + 1 == params.k or unsure:
            break
        logits = (yield Extend(entry, [sample.token_id], 1, meter))[-1]
    return samples, unsure


def _processed(entry: SessionCache, logits: torch.Tensor, params: DraftParams) -> torch.Tensor:
    """The logits of the next token (after ``entry.tokens``) processed as the target will process
    them, restricted to the ids the target can verify."""
    row = process_logits(logits[None], entry.tokens, len(entry.tokens), params.processing)[0]
    return _proposable(row, params)


def _proposable(logits: torch.Tensor, params: DraftParams) -> torch.Tensor:
    """The logits of the ids the target can verify: a draft whose output layer is padded to more
    rows than the target's proposes none of the extra ones (its proposal is then a distribution
    over the target's ids, so exactness holds; a shorter draft vocabulary needs nothing: the ids it
    lacks simply get probability 0)."""
    return logits[: params.vocab_limit] if 0 < params.vocab_limit < logits.shape[-1] else logits


def _finish(
    entry: SessionCache,
    drafted: tuple[list[DraftSample], bool],
    start: int,
    assumed: Sequence[int],
    meter: ComputeMeter,
) -> Block:
    samples, unsure = drafted
    return Block(
        samples=tuple(samples),
        start=start,
        assumed=tuple(assumed),
        cache_len=len(entry.tokens),
        cache_hash=prefix_hash(entry.tokens),
        compute_ms=meter.ms,
        ends_unsure=unsure,
    )


def propose_job(
    caches: SessionCaches,
    loaded: LoadedModel,
    session_id: str,
    sync: common_pb2.PrefixSync,
    params: DraftParams,
) -> Job[Block | None]:
    """K draft tokens after the committed prefix ``sync`` describes; None = resync required."""
    meter = ComputeMeter()
    try:
        entry = caches.sync(session_id, sync.base_len, sync.prefix_hash, sync.source_session_id)
    except ResyncRequired:
        return None
    logits = (yield Extend(entry, list(sync.tail_token_ids), 1, meter))[-1]
    start = sync.base_len + len(sync.tail_token_ids)
    drafted = yield from _draft_block(entry, logits, params, start, loaded.device, meter)
    return _finish(entry, drafted, start, (), meter)


def lookahead_job(
    caches: SessionCaches, loaded: LoadedModel, session_id: str, previous: Block, params: DraftParams
) -> Job[Block | None]:
    """The block after ``previous`` + the draft's guess of the next token; None if the cache moved on."""
    meter = ComputeMeter()
    try:
        entry = caches.sync(session_id, previous.cache_len, previous.cache_hash)
    except ResyncRequired:
        return None
    last = previous.samples[-1].token_id
    guess_logits = _processed(entry, (yield Extend(entry, [last], 1, meter))[-1], params)
    guess = int(guess_logits.argmax())  # the most likely next token (any warp keeps it)
    logits = (yield Extend(entry, [guess], 1, meter))[-1]
    assumed = (*previous.token_ids, guess)
    start = previous.start + len(assumed)
    drafted = yield from _draft_block(entry, logits, params, start, loaded.device, meter)
    return _finish(entry, drafted, start, assumed, meter)


def translated_propose_job(
    caches: SessionCaches,
    loaded: LoadedModel,
    bridge: VocabBridge,
    session_id: str,
    sync: common_pb2.PrefixSync,
    params: DraftParams,
) -> Job[Block | None]:
    """Up to K proposals in the target's ids after the committed prefix ``sync`` describes (in
    target ids), from a draft of another vocabulary; None = resync required.

    The session's mirror turns the committed ids into text and the text into the draft's own
    tokens; the cache keeps what it shares with them (after a partly accepted block, the draft
    tokens of the accepted text) and runs the rest. TLI samples only draft tokens that are
    also target tokens and sends their distribution in target ids; SLEM drafts greedily in its
    own vocabulary and sends the target's tokenization of the drafted text, one-hot. The target's
    history-dependent processing (penalties, bias, min_tokens) is not applied here (it is defined
    on target ids); it only costs acceptance, never exactness. A block may hold fewer than K
    tokens (SLEM's text may tokenize shorter; none while the text ends inside a character).
    """
    meter = ComputeMeter()
    start = sync.base_len + len(sync.tail_token_ids)
    if sync.base_len == 0:
        entry = caches.sync(session_id, 0, 0)
        mirror = entry.mirror = TextMirror(bridge)
    else:
        held = caches.get(session_id)
        if held is None or held.mirror is None or not held.mirror.holds(sync.base_len, sync.prefix_hash):
            caches.release(session_id)
            return None
        entry, mirror = held, held.mirror
    mirror.update(sync.base_len, sync.tail_token_ids)
    wanted = mirror.draft_ids
    if not wanted or (bridge.method == "slem" and mirror.pending):
        return Block((), start, (), start, 0, meter.ms)
    if len(wanted) + params.k > loaded.max_context_len:
        raise InvalidRequest(
            f"the session's text is {len(wanted)} tokens for the draft model, whose context is "
            f"{loaded.max_context_len}: it cannot draft {params.k} more"
        )
    keep = min(common_prefix_len(entry.tokens, wanted), len(wanted) - 1)
    entry.truncate(keep)
    logits = (yield Extend(entry, wanted[keep:], 1, meter))[-1]
    if bridge.method == "slem":
        greedy = dataclasses.replace(params, warp=Warp())
        drafted, unsure = yield from _draft_block(entry, logits, greedy, start, loaded.device, meter, _unshaped)
        proposed = mirror.slem_targets([s.token_id for s in drafted], params.k)
        samples = tuple(DraftSample(token_id=t) for t in proposed)
    else:
        barred = ~bridge.proposable(params.vocab_limit, logits.device)

        def intersect(_: SessionCache, row: torch.Tensor, __: DraftParams) -> torch.Tensor:
            return row.masked_fill(barred, float("-inf"))

        drafted, unsure = yield from _draft_block(entry, logits, params, start, loaded.device, meter, intersect)
        samples = tuple(_in_target_ids(s, bridge.id_map(logits.device)) for s in drafted)
    return Block(samples, start, (), cache_len=start, cache_hash=0, compute_ms=meter.ms, ends_unsure=unsure)


def _unshaped(_: SessionCache, logits: torch.Tensor, __: DraftParams) -> torch.Tensor:
    return logits


def _in_target_ids(sample: DraftSample, draft_to_target: torch.Tensor) -> DraftSample:
    """A TLI draft sample in target ids: the proposal keeps its probabilities (all on draft ids
    that are target tokens); the ids with probability 0 are left out."""
    token = int(draft_to_target[sample.token_id])
    if sample.probs is None:
        return DraftSample(token_id=token)
    probs = sample.probs
    ids = sample.ids if sample.ids is not None else torch.arange(probs.shape[0], device=probs.device)
    nonzero = probs > 0
    return DraftSample(token_id=token, ids=draft_to_target[ids[nonzero]], probs=probs[nonzero])
