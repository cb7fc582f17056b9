"""Per-session KV caches of one model, rolled back with crop.

Not thread-safe: a worker calls it from its single model thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specdec.modeling import LoadedModel
from specdec.tokens import prefix_hash


class ResyncRequired(Exception):
    """The worker's cache does not hold the committed prefix; the caller must resend from 0."""


@dataclass
class SessionCache:
    """Token ids in the KV cache, and the cache itself (always the same length)."""

    tokens: list[int]
    cache: DynamicCache
    last_used: float = field(default_factory=time.monotonic)

    def truncate(self, length: int) -> None:
        """Rolls back to the first ``length`` tokens."""
        excess = len(self.tokens) - length
        if excess > 0:
            self.cache.crop(-excess)
            del self.tokens[length:]


class SessionCaches:
    """LRU-bounded map of session id -> SessionCache for one model."""

    def __init__(self, loaded: LoadedModel, max_sessions: int, idle_s: float) -> None:
        self._loaded = loaded
        self._max_sessions = max_sessions
        self._idle_s = idle_s
        self._entries: OrderedDict[str, SessionCache] = OrderedDict()
        self.prefill_tokens_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def sync(self, session_id: str, base_len: int, base_hash: int) -> SessionCache:
        """The session's cache cut back to ``base_len`` committed tokens.

        ``base_len == 0`` always succeeds (a fresh cache). Otherwise the cache must hold at least
        ``base_len`` tokens whose hash is ``base_hash``, else ResyncRequired.
        """
        self.evict_idle()
        entry = self._entries.get(session_id)
        if base_len == 0:
            entry = SessionCache(tokens=[], cache=DynamicCache(config=self._loaded.model.config))
            self._entries[session_id] = entry
            self._evict_over_capacity()
        elif entry is None or len(entry.tokens) < base_len or prefix_hash(entry.tokens[:base_len]) != base_hash:
            self._entries.pop(session_id, None)
            raise ResyncRequired(session_id)
        else:
            entry.truncate(base_len)
        entry.last_used = time.monotonic()
        self._entries.move_to_end(session_id)
        return entry

    def extend(self, entry: SessionCache, token_ids: Sequence[int], num_logits: int) -> torch.Tensor:
        """Runs ``token_ids`` through the model on top of the cache.

        Returns float32 logits [num_logits, V] for the last ``num_logits`` positions.
        """
        if not token_ids:
            raise ValueError("extend needs at least one token")
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._loaded.device)
        with torch.inference_mode():
            out = self._loaded.model(
                input_ids=ids, past_key_values=entry.cache, use_cache=True, logits_to_keep=num_logits
            )
        entry.tokens.extend(token_ids)
        self.prefill_tokens_total += len(token_ids)
        return out.logits[0, -num_logits:].float()

    def release(self, session_id: str) -> bool:
        """Frees a session's cache; False when there was none."""
        return self._entries.pop(session_id, None) is not None

    def evict_idle(self) -> None:
        """Frees caches unused for longer than the idle limit."""
        cutoff = time.monotonic() - self._idle_s
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.last_used >= cutoff:
                break
            del self._entries[oldest_id]

    def _evict_over_capacity(self) -> None:
        while len(self._entries) > self._max_sessions:
            self._entries.popitem(last=False)
