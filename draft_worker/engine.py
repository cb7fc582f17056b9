"""Drafting: autoregressive proposals from the small model, with the distributions they came from.

``propose_job`` drafts K tokens after a committed prefix. ``lookahead_job`` (pipelining) drafts
the block after one it already proposed, assuming that block is fully accepted and followed by
the draft's own guess of the target's next token. Each draft token is sampled with the generator
of its absolute position (specdec.runtime.sampling.position_generator), so a lookahead block that is used
is exactly the block a fresh request at that prefix would have produced.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from specdec.runtime.kvcache import ResyncRequired, SessionCache, SessionCaches
from specdec.runtime.modeling import LoadedModel
from specdec.runtime.processing import NO_PROCESSING, Processing, process_logits
from specdec.runtime.sampling import DraftSample, Warp, position_generator, sample_draft_token
from specdec.runtime.scheduler import ComputeMeter, Extend, Job
from specdec.runtime.tokens import prefix_hash
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
) -> Generator[Extend, torch.Tensor, list[DraftSample]]:
    """Samples ``params.k`` tokens starting from ``logits`` (the distribution after ``start`` tokens)."""
    samples: list[DraftSample] = []
    for i in range(params.k):
        generator = None if params.warp.greedy else position_generator(params.seed, start + i, "draft", device)
        sample = sample_draft_token(_processed(entry, logits, params), params.warp, params.top_n, generator)
        samples.append(sample)
        if i + 1 < params.k:
            logits = (yield Extend(entry, [sample.token_id], 1, meter))[-1]
    return samples


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
    entry: SessionCache, samples: list[DraftSample], start: int, assumed: Sequence[int], meter: ComputeMeter
) -> Block:
    return Block(
        samples=tuple(samples),
        start=start,
        assumed=tuple(assumed),
        cache_len=len(entry.tokens),
        cache_hash=prefix_hash(entry.tokens),
        compute_ms=meter.ms,
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
    samples = yield from _draft_block(entry, logits, params, start, loaded.device, meter)
    return _finish(entry, samples, start, (), meter)


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
    samples = yield from _draft_block(entry, logits, params, start, loaded.device, meter)
    return _finish(entry, samples, start, assumed, meter)
