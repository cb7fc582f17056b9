"""Session state stores: ``memory://`` (one coordinator) and ``redis://`` / ``rediss://``."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

from specdec.state.base import (
    RECENT_STEPS,
    TOMBSTONE_EXTRA_MS,
    CacheLocation,
    Commit,
    CommitOutcome,
    CommitResult,
    PrefixLocation,
    SessionRecord,
    StateStore,
)
from specdec.state.memory import MemoryStateStore
from specdec.state.redis_store import FileCredentials, RedisStateStore

__all__ = [
    "RECENT_STEPS",
    "TOMBSTONE_EXTRA_MS",
    "CacheLocation",
    "Commit",
    "CommitOutcome",
    "CommitResult",
    "MemoryStateStore",
    "PrefixLocation",
    "RedisStateStore",
    "SessionRecord",
    "StateStore",
    "open_store",
    "store_location",
]


def store_location(url: str) -> str:
    """``url`` without its credentials and options (user, password, query): fit for a log."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def open_store(
    url: str,
    ttl_s: float,
    lease_s: float,
    timeout_s: float,
    *,
    username: str | None = None,
    password: str | None = None,
    password_file: str | None = None,
    tls_ca_file: str | None = None,
    memory_max_tokens: int = 0,
    max_sessions_per_caller: int = 0,
    replica_acks: int = 0,
    replica_wait_s: float = 1.0,
    max_session_tokens_per_caller: int = 0,
) -> StateStore:
    """A store for ``url``: ``memory://``, ``redis://[user:password@]host:port/db`` or ``rediss://...``.

    ``username``/``password`` (Redis ACL / AUTH): in the URL or as these, not both (a
    ``password_file`` instead of ``password``: read again when it changes, for the connections
    that follow);
    ``tls_ca_file`` is the CA that signed a ``rediss://`` server's certificate;
    ``memory_max_tokens`` bounds a ``memory://`` store (see MemoryStateStore; 0 = no bound);
    ``max_sessions_per_caller``: the sessions one caller may hold (StateStore.acquire; 0 = no limit);
    ``max_session_tokens_per_caller``: the tokens they may hold before its turns are refused (0 = no limit);
    ``replica_acks``, ``replica_wait_s``: a Redis's replicas that must have a commit (RedisStateStore).
    """
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme == "memory":
        if replica_acks:
            raise ValueError("state_replica_acks needs a redis:// or rediss:// state_url: memory:// has no replicas")
        return MemoryStateStore(
            ttl_s=ttl_s, lease_s=lease_s, max_tokens=memory_max_tokens, max_sessions_per_caller=max_sessions_per_caller,
            max_session_tokens_per_caller=max_session_tokens_per_caller,
        )  # fmt: skip
    if sum((password is not None, bool(password_file), bool(parts.password))) > 1:
        raise ValueError(
            "the Redis password is given twice (state_url, --state-password, --state-password-file); keep one"
        )
    if username and parts.username and unquote(parts.username) != username:
        raise ValueError("the Redis user is given twice (state_url, --state-username), differently; keep one")
    if tls_ca_file and scheme != "rediss":
        raise ValueError("state_tls_ca_file needs a rediss:// state_url")
    if scheme in ("redis", "rediss", "unix"):
        auth: dict[str, object] = {"username": username, "password": password, "ssl_ca_certs": tls_ca_file}
        if password_file:  # the provider gives the user too: redis-py takes no user beside it
            user = username or (unquote(parts.username) if parts.username else None)
            url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
            auth |= {"credential_provider": FileCredentials(user, password_file), "username": None}
        extra = {key: value for key, value in auth.items() if value is not None}
        return RedisStateStore(
            url,
            ttl_s=ttl_s,
            lease_s=lease_s,
            timeout_s=timeout_s,
            max_sessions_per_caller=max_sessions_per_caller,
            max_session_tokens_per_caller=max_session_tokens_per_caller,
            replica_acks=replica_acks,
            replica_wait_s=replica_wait_s,
            **extra,
        )
    raise ValueError(f"unsupported state_url scheme {scheme!r}: use memory://, redis://, rediss:// or unix://")
