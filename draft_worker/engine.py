"""Drafting: autoregressive proposals from the small model, with the distributions they came from."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.kvcache import ResyncRequired
from specdec.sampling import DraftSample, Warp, round_generator, sample_draft_token
from specdec.worker import WorkerCore


@dataclass(frozen=True)
class ProposeResult:
    """``resync`` set: the cache did not hold the committed prefix and nothing was computed."""

    resync: bool
    samples: tuple[DraftSample, ...] = ()
    cache_len: int = 0
    compute_ms: float = 0.0


class DraftEngine:
    """Runs in the worker's model thread."""

    def __init__(self, core: WorkerCore, proposal_top_n: int) -> None:
        self._core = core
        self._top_n = proposal_top_n

    def propose(
        self,
        session_id: str,
        base_len: int,
        base_hash: int,
        tail: Sequence[int],
        num_tokens: int,
        warp: Warp,
        seed: int,
    ) -> ProposeResult:
        """Proposes ``num_tokens`` tokens after the committed tokens ``[..base_len] + tail``."""
        started = time.perf_counter()
        caches = self._core.caches
        try:
            entry = caches.sync(session_id, base_len, base_hash)
        except ResyncRequired:
            return ProposeResult(resync=True)
        committed_len = base_len + len(tail)
        generator = None if warp.greedy else round_generator(seed, committed_len, "draft", self._core.loaded.device)
        logits = caches.extend(entry, tail, num_logits=1)[-1]
        samples: list[DraftSample] = []
        for i in range(num_tokens):
            sample = sample_draft_token(logits, warp, self._top_n, generator)
            samples.append(sample)
            if i + 1 < num_tokens:
                logits = caches.extend(entry, [sample.token_id], num_logits=1)[-1]
        return ProposeResult(
            resync=False,
            samples=tuple(samples),
            cache_len=len(entry.tokens),
            compute_ms=(time.perf_counter() - started) * 1000,
        )
