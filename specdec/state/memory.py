"""In-process state store (``memory://``) for a single coordinator: local runs, demo, tests."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence

import structlog

from specdec.serving.errors import SessionBusy, SessionNotFound, StateConflict, StateStoreFull
from specdec.state.base import (
    RECENT_STEPS,
    STORE_FULL,
    TOMBSTONE_EXTRA_MS,
    CacheLocation,
    Commit,
    CommitOutcome,
    CommitResult,
    PrefixLocation,
    SessionRecord,
    StateStore,
    session_conflict,
    session_gone,
    too_many_session_tokens,
    too_many_sessions,
)

MAX_PREFIXES = 100_000  # prefix entries kept (the oldest go first)
# What a session counts for against the store's limit besides its token ids (its record's own
# memory: about 2 KiB, where an id in a Python list takes about 36 bytes).
SESSION_TOKENS = 64

log = structlog.get_logger(__name__)


def _clamped(location: CacheLocation | None, committed: int) -> CacheLocation | None:
    """A rollback shortens what any cache can validly hold."""
    if location is None or location.length <= committed:
        return location
    return dataclasses.replace(location, length=committed)


@dataclasses.dataclass(frozen=True)
class _OpenTurn:
    """What a turn's first commit replaced (see Commit.opens_turn)."""

    tokens: list[int]
    chat: str
    created: bool


class MemoryStateStore(StateStore):
    """Same semantics as the Redis store, held in a dict. ``max_tokens`` (0 = none) bounds it as
    Redis's maxmemory does: the token ids its sessions and their open turns' copies hold, each
    session counted SESSION_TOKENS more; what would grow it past that is refused (StateStoreFull),
    what shrinks or keeps it (a turn's rollback, releases, deletions) is not.
    ``max_sessions_per_caller`` (0 = none): the sessions one caller may hold;
    ``max_session_tokens_per_caller`` (0 = none): the tokens one caller's sessions may hold before
    its turns are refused (StateStore.acquire)."""

    def __init__(
        self,
        ttl_s: float,
        lease_s: float,
        max_tokens: int = 0,
        max_sessions_per_caller: int = 0,
        max_session_tokens_per_caller: int = 0,
    ) -> None:
        self._ttl_s = ttl_s
        self._lease_s = lease_s
        self._max_tokens = max_tokens
        self._max_sessions = max_sessions_per_caller
        self._max_caller_tokens = max_session_tokens_per_caller
        self._callers: dict[str, set[str]] = {}  # caller -> the sessions counted against its limit
        self._caller_of: dict[str, str] = {}  # session -> the caller it is counted for
        self._held = 0  # what max_tokens bounds (see tokens_held)
        self._records: dict[str, SessionRecord] = {}
        # session -> when its TTL runs out; every touch sets now + the TTL and moves it to the end,
        # so the order is the expiry order
        self._expires: OrderedDict[str, float] = OrderedDict()
        self._lease_until: dict[str, float] = {}
        self._open_turns: dict[str, _OpenTurn] = {}
        # owner -> until when its acquire is refused; expiries grow with insertion (now + a constant)
        self._released: OrderedDict[str, float] = OrderedDict()
        # prefix key -> (location, expiry), oldest first; at most MAX_PREFIXES
        self._prefixes: OrderedDict[str, tuple[PrefixLocation, float]] = OrderedDict()
        self._lock = asyncio.Lock()

    @property
    def tokens_held(self) -> int:
        """The token ids the sessions and their open turns' copies hold, each session counted
        SESSION_TOKENS more: what ``max_tokens`` bounds."""
        return self._held

    def _footprint(self, session_id: str) -> int:
        record = self._records.get(session_id)
        if record is None:
            return 0
        turn = self._open_turns.get(session_id)
        return SESSION_TOKENS + len(record.tokens) + (len(turn.tokens) if turn else 0)

    def _make_room(self, growth: int) -> None:
        """Refuses ``growth`` more tokens held past ``max_tokens``."""
        if self._max_tokens and growth > 0 and self._held + growth > self._max_tokens:
            log.warning(
                "state_store_full", held=self._held, limit=self._max_tokens,
                hint="raise --state-memory-max-tokens, lower --session-ttl-s, or keep sessions in Redis",
            )  # fmt: skip
            raise StateStoreFull(STORE_FULL)

    def _live(self, session_id: str, now: float) -> SessionRecord | None:
        if self._expires.get(session_id, now + 1) <= now:
            self._drop(session_id)
        return self._records.get(session_id)

    def _gone_unless_live(self, session_id: str, created_at: float | None, now: float) -> SessionRecord:
        """The live session made at ``created_at`` (None: any); SessionGone when there is none."""
        record = self._live(session_id, now)
        if record is None or created_at not in (None, record.created_at):
            raise session_gone(session_id)
        return record

    def _drop(self, session_id: str) -> None:
        self._held -= self._footprint(session_id)
        self._records.pop(session_id, None)
        self._expires.pop(session_id, None)
        self._lease_until.pop(session_id, None)
        self._open_turns.pop(session_id, None)
        caller = self._caller_of.pop(session_id, None)
        if caller is not None:
            sessions = self._callers[caller]
            sessions.discard(session_id)
            if not sessions:
                del self._callers[caller]

    def _undo_open_turn(self, record: SessionRecord, now: float) -> SessionRecord | None:
        """Undoes the turn its owner left open; None when that turn had created the session."""
        turn = self._open_turns.get(record.session_id)
        if turn is None:
            return record
        if turn.created:
            self._drop(record.session_id)
            return None
        before = self._footprint(record.session_id)
        del self._open_turns[record.session_id]
        record.tokens = turn.tokens
        record.chat = turn.chat
        record.target, record.draft = _clamped(record.target, 0), _clamped(record.draft, 0)
        record.version += 1
        record.updated_at = now
        self._held += self._footprint(record.session_id) - before
        return record

    def _sweep(self, now: float) -> None:
        """Drops every session whose TTL has run out, named again or not."""
        while self._expires:
            session_id, expires = next(iter(self._expires.items()))
            if expires > now:
                return
            self._drop(session_id)

    def _touch(self, session_id: str, now: float) -> None:
        self._expires[session_id] = now + self._ttl_s
        self._expires.move_to_end(session_id)
        self._lease_until[session_id] = now + self._lease_s

    async def acquire(self, session_id: str, owner: str, *, create: bool, caller: str | None = None) -> SessionRecord:
        async with self._lock:
            now = time.time()
            self._sweep(now)
            if self._released.get(owner, 0.0) > now:
                raise StateConflict(f"the request holding session {session_id!r} already ended")
            record = self._live(session_id, now)
            if record is not None and record.owner != owner:
                if record.owner and self._lease_until.get(session_id, 0) > now:
                    raise SessionBusy(f"session {session_id!r} is generating for another request; retry when it ends")
                record = self._undo_open_turn(record, now)
            counted = caller if self._max_sessions > 0 or self._max_caller_tokens > 0 else None
            if counted is not None and self._max_caller_tokens > 0:
                held = sum(len(self._records[s].tokens) for s in self._callers.get(counted, ()))
                if held >= self._max_caller_tokens:
                    raise too_many_session_tokens(self._max_caller_tokens, held)
            if record is None:
                if not create:
                    raise SessionNotFound(f"session {session_id!r} does not exist or has expired")
                if counted is not None and 0 < self._max_sessions <= len(self._callers.get(counted, ())):
                    raise too_many_sessions(self._max_sessions)
                self._make_room(SESSION_TOKENS)
                record = SessionRecord(session_id=session_id, created_at=now, updated_at=now)
                self._records[session_id] = record
                self._held += SESSION_TOKENS
                if counted is not None:
                    self._callers.setdefault(counted, set()).add(session_id)
                    self._caller_of[session_id] = counted
            record.owner = owner
            self._touch(session_id, now)
            return copy.deepcopy(record)

    async def commit(self, session_id: str, owner: str, commit: Commit) -> CommitResult:
        async with self._lock:
            now = time.time()
            record = self._gone_unless_live(session_id, commit.created_at, now)
            if commit.step_id in record.recent_steps:
                return CommitResult(CommitOutcome.ALREADY_APPLIED, record.version)
            if commit.expected_version is not None and record.version != commit.expected_version:
                raise session_conflict(session_id, taken=False)
            if record.owner != owner:
                raise session_conflict(session_id, taken=True)
            commit.check(len(record.tokens))
            before = self._footprint(session_id)
            if not (commit.expected_version is None and commit.closes_turn):  # a rollback never grows it
                self._make_room(self._footprint_after(record, commit) - before)
            if commit.opens_turn:
                self._open_turns[session_id] = _OpenTurn(list(record.tokens), record.chat, record.version == 0)
            if commit.closes_turn:
                self._open_turns.pop(session_id, None)
            if commit.truncate_to is not None:
                del record.tokens[commit.truncate_to :]
            kept = len(record.tokens)  # a location this commit does not set is valid this far, at most
            record.tokens.extend(commit.append)
            if commit.chat is not None:
                record.chat = commit.chat
            record.version += 1
            record.recent_steps = [*record.recent_steps, commit.step_id][-RECENT_STEPS:]
            record.updated_at = now
            record.target = commit.target or _clamped(record.target, kept)
            record.draft = commit.draft or _clamped(record.draft, kept)
            self._held += self._footprint(session_id) - before
            self._touch(session_id, now)
            return CommitResult(CommitOutcome.APPLIED, record.version)

    def _footprint_after(self, record: SessionRecord, commit: Commit) -> int:
        """The session's footprint once ``commit`` is applied (as ``commit`` applies it)."""
        turn = self._open_turns.get(record.session_id)
        copy_len = len(turn.tokens) if turn else 0
        if commit.opens_turn:
            copy_len = len(record.tokens)
        if commit.closes_turn:
            copy_len = 0
        kept = len(record.tokens) if commit.truncate_to is None else min(commit.truncate_to, len(record.tokens))
        return SESSION_TOKENS + kept + len(commit.append) + copy_len

    async def put_prefixes(self, keys: Sequence[str], location: PrefixLocation, ttl_s: float) -> None:
        expires = time.time() + ttl_s
        for key in keys:
            self._prefixes.pop(key, None)
            self._prefixes[key] = (location, expires)
        while len(self._prefixes) > MAX_PREFIXES:
            self._prefixes.popitem(last=False)

    async def find_prefix(self, keys: Sequence[str]) -> tuple[int, PrefixLocation] | None:
        now = time.time()
        for index in range(len(keys) - 1, -1, -1):
            hit = self._prefixes.get(keys[index])
            if hit is not None and hit[1] > now:
                return index, hit[0]
        return None

    async def renew(self, session_id: str, owner: str, created_at: float | None = None) -> bool:
        async with self._lock:
            now = time.time()
            record = self._gone_unless_live(session_id, created_at, now)
            if record.owner != owner:
                return False
            self._touch(session_id, now)
            return True

    async def release(self, session_id: str, owner: str, *, delete: bool = False) -> None:
        async with self._lock:
            now = time.time()
            while self._released and next(iter(self._released.values())) <= now:
                self._released.popitem(last=False)
            self._released[owner] = now + self._lease_s + TOMBSTONE_EXTRA_MS / 1000
            self._released.move_to_end(owner)
            record = self._live(session_id, now)
            if record is not None and record.owner == owner:
                if delete:
                    self._drop(session_id)
                    return
                record.owner = ""
                self._lease_until.pop(session_id, None)

    async def mark_draft_ready(self, session_id: str, claimed: CacheLocation) -> bool:
        async with self._lock:
            record = self._live(session_id, time.time())
            if record is None or record.draft != claimed:
                return False
            record.draft = dataclasses.replace(claimed, ready_by=0.0)
            return True

    async def get(self, session_id: str) -> SessionRecord | None:
        async with self._lock:
            record = self._live(session_id, time.time())
            return copy.deepcopy(record) if record else None

    async def delete(self, session_id: str) -> bool:
        async with self._lock:
            existed = self._live(session_id, time.time()) is not None
            self._drop(session_id)
            return existed

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
