"""The session state store interface and its records.

A session record holds small metadata only (never tensors): committed token ids, a version
bumped on every commit (the fencing token), the id of the last applied commit step, the lease
owner (the one request allowed to generate in the session), where each worker's KV cache is and
how much of the committed prefix it holds. Every key expires
after a TTL that each commit refreshes.
"""

from __future__ import annotations

import enum
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specdec.serving.errors import SessionGone, StateConflict, TooManySessions, TooManySessionTokens

RECENT_STEPS = 16  # a re-sent commit is recognised while it is among the last this many applied
# A released owner's acquire is refused for the lease time plus this (an acquire delayed longer
# than any socket timeout and retry cannot come back from the dead).
TOMBSTONE_EXTRA_MS = 60_000
# What a request that a full store (its memory limit reached) cannot save is told, by every store.
STORE_FULL = (
    "the state store is full (its memory limit is reached): this request cannot be saved; "
    "retry later, or close sessions you no longer need (CloseSession)"
)


def too_many_sessions(limit: int) -> TooManySessions:
    """What a caller at its session limit is told when a request would make one more."""
    return TooManySessions(
        f"you have {limit} sessions open, the most this server keeps for one caller: close sessions you no "
        "longer need (CloseSession), continue one of them, or wait for idle ones to expire"
    )


def too_many_session_tokens(limit: int, held: int) -> TooManySessionTokens:
    """What a caller whose sessions hold its budget of tokens is told when a request would
    continue or make one."""
    return TooManySessionTokens(
        f"your sessions hold {held} tokens, the most this server keeps for one caller is {limit}: close "
        "sessions you no longer need (CloseSession) or wait for idle ones to expire"
    )


def session_gone(session_id: str) -> SessionGone:
    """What a turn's commit or renewal meets when its session expired, was closed, or was made
    again since the turn acquired it (every store says it alike)."""
    return SessionGone(f"session {session_id!r} expired or was closed during the request")


def session_conflict(session_id: str, *, taken: bool) -> StateConflict:
    """A commit refused: another request holds the lease (``taken``), or the session's version
    moved on from the one the commit expected."""
    what = "was taken over by another request" if taken else "was changed by another request"
    return StateConflict(f"session {session_id!r} {what}")


@dataclass(frozen=True)
class CacheLocation:
    """A worker replica's KV cache for a session: valid for the first ``length`` committed tokens.
    ``source``: another session whose cache there holds them, when the session's own does not yet
    (prefix reuse: a worker that has not run since the session found its prefix in that cache);
    empty: the session's own. ``ready_by``: the wall-clock time (Unix seconds) by which the worker
    has computed the last of those tokens, sent to it without waiting for its answer, or given
    up on them (a later call of the session waits behind them until then); 0: it holds them."""

    address: str
    length: int
    source: str = ""
    ready_by: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> CacheLocation | None:
        if not raw:
            return None
        return cls.from_fields(json.loads(raw))

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> CacheLocation:
        # records written by older versions carry more keys, or no source or ready_by
        return cls(
            address=fields["address"],
            length=int(fields["length"]),
            source=fields.get("source", ""),
            ready_by=float(fields.get("ready_by", 0.0)),
        )


@dataclass(frozen=True)
class PrefixLocation:
    """Where a token prefix is cached (prefix reuse): the worker cache (a session id) that holds
    it, and how many of its first tokens each worker's copy holds (in the cache of a location's
    ``source`` where it has one)."""

    cache_id: str
    target: CacheLocation | None
    draft: CacheLocation | None

    def to_json(self) -> str:
        return json.dumps(
            {
                "cache_id": self.cache_id,
                "target": asdict(self.target) if self.target else None,
                "draft": asdict(self.draft) if self.draft else None,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> PrefixLocation:
        fields = json.loads(raw)
        target, draft = fields.get("target"), fields.get("draft")
        return cls(
            cache_id=fields["cache_id"],
            target=CacheLocation.from_fields(target) if target else None,
            draft=CacheLocation.from_fields(draft) if draft else None,
        )


@dataclass
class SessionRecord:
    """A session as stored."""

    session_id: str
    tokens: list[int] = field(default_factory=list)
    version: int = 0
    recent_steps: list[str] = field(default_factory=list)
    owner: str = ""
    target: CacheLocation | None = None
    draft: CacheLocation | None = None
    chat: str = ""  # the conversation (JSON) of a session driven by chat messages; "" = none
    created_at: float = 0.0
    updated_at: float = 0.0


@dataclass(frozen=True)
class Commit:
    """One atomic change to a session, applied only if the version is still ``expected_version``
    (``None``: whatever the version, as long as the committer holds the lease; a turn rolling back
    its own work uses it, so that a rollback whose first attempt was lost still applies).

    ``step_id`` names the change: re-sending a commit whose step is among the last
    RECENT_STEPS applied reports ALREADY_APPLIED instead of applying it twice. ``truncate_to`` (an explicit rollback)
    cuts the committed tokens before ``append`` is added. ``None`` cache locations are unchanged
    (but cut to the tokens kept: a location is never longer than the tokens it was computed for).

    A turn is atomic even when its request dies without rolling back (its coordinator killed, the
    store unreachable past the retries): the turn's first commit ``opens_turn``, and the store keeps
    what that commit replaced (the tokens it cut, the conversation, whether the session was new)
    until a commit that ``closes_turn`` (the last round's, or the turn's own rollback). An acquire
    that finds a turn open under an owner that no longer holds the lease undoes it first: the
    tokens and conversation as they were, both cache lengths 0 (as a rollback leaves them), or the
    session deleted when that turn created it.
    """

    def __post_init__(self) -> None:
        if not self.step_id or "|" in self.step_id:
            raise ValueError(f"step_id must be non-empty and free of '|', got {self.step_id!r}")

    def check(self, committed_len_before: int) -> None:
        """Raises ValueError for a commit that would break the store's invariants (a bug)."""
        kept = committed_len_before if self.truncate_to is None else min(self.truncate_to, committed_len_before)
        after = kept + len(self.append)
        for location in (self.target, self.draft):
            if location is not None and location.length > after:
                raise ValueError(f"cache length {location.length} exceeds the committed length {after}")

    expected_version: int | None
    step_id: str
    append: Sequence[int] = ()
    truncate_to: int | None = None
    target: CacheLocation | None = None
    draft: CacheLocation | None = None
    chat: str | None = None  # the new conversation (JSON) of a chat session; None = unchanged
    opens_turn: bool = False  # a turn's first commit: keep what it replaces until the turn closes
    closes_turn: bool = False  # the turn finished or rolled itself back: nothing left to undo
    # the creation time of the session the committer acquired (SessionRecord.created_at): a session
    # made since (that one closed or expired, another made under its id) is gone for it; None = any
    created_at: float | None = None


class CommitOutcome(enum.Enum):
    APPLIED = "applied"
    ALREADY_APPLIED = "already_applied"


@dataclass(frozen=True)
class CommitResult:
    outcome: CommitOutcome
    version: int


class StateStore(ABC):
    """Session state shared by coordinator replicas; every method is safe to retry.

    Invariants every implementation keeps: the version grows by one per applied commit (and per
    undo of a turn left open, see Commit); the committed tokens only grow, except through a
    commit with ``truncate_to`` (an explicit rollback, which bumps the version like any commit)
    or such an undo; a recorded cache length never exceeds the committed length.
    """

    async def start(self) -> None:
        """Connects and checks the store (raises StateUnavailable); called once at start-up."""
        await self.ping()

    @abstractmethod
    async def acquire(self, session_id: str, owner: str, *, create: bool, caller: str | None = None) -> SessionRecord:
        """Takes the session's lease for ``owner`` and returns the record.

        Creates an empty session when ``create`` and it does not exist. Raises SessionNotFound
        (missing, not ``create``) or SessionBusy (another owner holds an unexpired lease). A turn
        left open by an owner whose lease has lapsed or been released is undone first (Commit).
        ``caller``: whose session it is, when the store's limits per caller count it (None: not
        counted, as a one-shot request's); a session it would make past the limit of sessions
        raises TooManySessions, and any session of a caller whose counted sessions hold its budget
        of tokens or more raises TooManySessionTokens (the turn would grow them). A session counts
        from its making until it is deleted or expires; one made while both limits were off is
        not counted.
        """

    @abstractmethod
    async def commit(self, session_id: str, owner: str, commit: Commit) -> CommitResult:
        """Applies ``commit`` atomically (compare-and-set on the version; refreshes lease and TTL).

        Raises SessionGone (a StateConflict) when the session is gone (closed or expired),
        StateConflict when the version moved on or ``owner`` no longer holds the lease.
        """

    @abstractmethod
    async def renew(self, session_id: str, owner: str, created_at: float | None = None) -> bool:
        """Extends ``owner``'s lease by the lease time (and the TTL); False when another request
        holds the session (the lease lapsed and was taken). Raises SessionGone when the session is
        gone (closed or expired), or was made again since it was created at ``created_at``
        (SessionRecord.created_at; None: any), as a commit does."""

    @abstractmethod
    async def release(self, session_id: str, owner: str, *, delete: bool = False) -> None:
        """Gives the lease up (a no-op when ``owner`` does not hold it); ``delete``: deletes the
        session instead, if ``owner`` still holds it (a turn that made its session and did not
        finish: a session closed and made again by another request meanwhile is that request's).
        ``owner`` can never acquire again: an acquire of it that arrives after the release (a
        cancelled call still in flight) raises StateConflict, so acquire and release may reach
        the store in any order."""

    @abstractmethod
    async def mark_draft_ready(self, session_id: str, claimed: CacheLocation) -> bool:
        """The draft has computed the prefix that a turn sent it without waiting and recorded as
        ``claimed`` (its ``ready_by`` set): the session's draft location, if it still is
        ``claimed``, becomes held (``ready_by`` 0), so later calls need not wait. Needs no lease
        (the turn has ended; a later commit that recorded another location wins); False when the
        location is another by now or the session is gone."""

    @abstractmethod
    async def get(self, session_id: str) -> SessionRecord | None:
        """The record, or None when it does not exist."""

    @abstractmethod
    async def delete(self, session_id: str) -> bool:
        """Deletes the session; False when it did not exist."""

    @abstractmethod
    async def put_prefixes(self, keys: Sequence[str], location: PrefixLocation, ttl_s: float) -> None:
        """Records that ``location`` caches the prefixes named by ``keys`` (block chain hashes,
        specdec.runtime.tokens.block_hashes); each entry expires after ``ttl_s``."""

    @abstractmethod
    async def find_prefix(self, keys: Sequence[str]) -> tuple[int, PrefixLocation] | None:
        """The longest recorded prefix among ``keys`` (chain hashes, shortest prefix first): its
        index in ``keys`` and where it is cached; None when none is recorded."""

    @abstractmethod
    async def ping(self) -> None:
        """Raises StateUnavailable when the store cannot be reached."""

    @abstractmethod
    async def close(self) -> None:
        """Releases connections."""
