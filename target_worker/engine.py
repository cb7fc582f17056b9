"""Verification: one forward pass over the uncached tail and the draft block, then rejection sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime.kvcache import ResyncRequired, SessionCaches
from specdec.runtime.modeling import LoadedModel
from specdec.runtime.proposals import decode_block
from specdec.runtime.sampling import Warp, position_generator, rejection_sample
from specdec.runtime.scheduler import ComputeMeter, Extend, Job
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class VerifyResult:
    """``resync`` set: the cache did not hold the committed prefix and nothing was computed."""

    resync: bool
    num_accepted: int = 0
    token_ids: tuple[int, ...] = ()
    cache_len: int = 0
    computed_tokens: int = 0
    compute_ms: float = 0.0


def verify_job(
    caches: SessionCaches,
    loaded: LoadedModel,
    session_id: str,
    sync: common_pb2.PrefixSync,
    block: common_pb2.DraftBlock,
    warp: Warp,
    seed: int,
) -> Job[VerifyResult]:
    """Verifies ``block`` after the committed prefix ``sync`` describes (one Extend step)."""
    meter = ComputeMeter()
    drafts, q = decode_block(block, loaded.vocab_size, loaded.device)
    base_len, tail = sync.base_len, list(sync.tail_token_ids)
    try:
        entry = caches.sync(session_id, base_len, sync.prefix_hash)
    except ResyncRequired:
        return VerifyResult(resync=True)
    k = len(drafts)
    logits = yield Extend(entry, [*tail, *drafts.tolist()], k + 1, meter)
    committed_len = base_len + len(tail)
    generators = None
    if not warp.greedy:  # row i decides the token at position committed_len + i
        generators = [position_generator(seed, committed_len + i, "target", loaded.device) for i in range(k + 1)]
    if q is None and not warp.greedy:
        q = torch.nn.functional.one_hot(drafts, loaded.vocab_size).float()
    verdict = rejection_sample(logits, drafts, q, warp, generators)
    entry.truncate(committed_len + verdict.num_accepted)
    return VerifyResult(
        resync=False,
        num_accepted=verdict.num_accepted,
        token_ids=tuple(verdict.token_ids),
        cache_len=len(entry.tokens),
        computed_tokens=len(tail) + k,
        compute_ms=meter.ms,
    )
