"""Session state stores: ``memory://`` (one coordinator) and ``redis://`` / ``rediss://``."""

from __future__ import annotations

from urllib.parse import urlsplit

from specdec.state.base import (
    RECENT_STEPS,
    CacheLocation,
    Commit,
    CommitOutcome,
    CommitResult,
    SessionRecord,
    StateStore,
)
from specdec.state.memory import MemoryStateStore
from specdec.state.redis_store import RedisStateStore

__all__ = [
    "RECENT_STEPS",
    "CacheLocation",
    "Commit",
    "CommitOutcome",
    "CommitResult",
    "MemoryStateStore",
    "RedisStateStore",
    "SessionRecord",
    "StateStore",
    "open_store",
]


def open_store(url: str, ttl_s: float, lease_s: float, timeout_s: float) -> StateStore:
    """A store for ``url``: ``memory://``, ``redis://[:password@]host:port/db`` or ``rediss://...``."""
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return MemoryStateStore(ttl_s=ttl_s, lease_s=lease_s)
    if scheme in ("redis", "rediss", "unix"):
        return RedisStateStore(url, ttl_s=ttl_s, lease_s=lease_s, timeout_s=timeout_s)
    raise ValueError(f"unsupported state_url scheme {scheme!r}: use memory://, redis://, rediss:// or unix://")
