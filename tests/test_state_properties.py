"""Property tests of the state store's invariants, against memory:// and a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import subprocess
import sys
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from specdec.serving.errors import SessionNotFound, StateConflict, TooManySessions
from specdec.state import RECENT_STEPS, CacheLocation, Commit, CommitOutcome, StateStore, open_store
from specdec.state.memory import SESSION_TOKENS, MemoryStateStore
from tests.helpers import RedisServer

TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=5)
# a draft location's ready_by: held, or a time (one with more digits than a cut's re-encoding keeps)
READY_BY = st.sampled_from([0.0, 1_800_000_000.25, 1_764_590_000.123456])


class StoreMachine(RuleBasedStateMachine):
    """Random sequences of commits, retries, stale writes, rollbacks, foreign writers, and turns
    that open, close or are abandoned (their owner gone without closing them; the next owner's
    acquire undoes them).

    Invariants: the store equals a simple model; the version grows by exactly one per applied
    commit (and per undo); the committed length shrinks only through an explicit rollback or an
    undo; recorded cache lengths never exceed the committed length.
    """

    url = "memory://"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store: StateStore = open_store(self.url, ttl_s=60, lease_s=60, timeout_s=2)
        self.run(self.store.start())
        self.session = f"prop-{uuid.uuid4().hex[:8]}"
        self.steps = itertools.count()
        self.tokens: list[int] = []
        self.version = 0
        self.last_commit: Commit | None = None
        self.recent: list[Commit] = []
        self.last_len = 0
        self.last_was_rollback = False
        self.owner = f"{self.session}-0"  # a released owner name is refused for good: unique ones
        self.owners = itertools.count(1)
        self.before_turn: tuple[list[int], int] | None = None  # the open turn's tokens and version before it

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.store.delete(self.session))
        self.run(self.store.close())
        self.loop.close()

    @initialize()
    def create(self) -> None:
        self.run(self.store.acquire(self.session, self.owner, create=True))

    def _apply(self, commit: Commit) -> None:
        if commit.opens_turn:
            self.before_turn = (list(self.tokens), self.version)
        if commit.closes_turn:
            self.before_turn = None
        result = self.run(self.store.commit(self.session, self.owner, commit))
        assert result.outcome is CommitOutcome.APPLIED
        assert result.version == self.version + 1
        self.version = result.version
        self.last_commit = commit
        self.recent = [*self.recent, commit][-RECENT_STEPS:]
        self.last_was_rollback = commit.truncate_to is not None
        if commit.truncate_to is not None:
            del self.tokens[commit.truncate_to :]
        self.tokens += commit.append

    @rule(append=TOKENS, data=st.data())
    def commit(self, append: list[int], data: st.DataObject) -> None:
        after = len(self.tokens) + len(append)
        target = CacheLocation("t:1", data.draw(st.integers(0, after)))
        length, ready_by = data.draw(st.integers(0, after)), data.draw(READY_BY)
        draft = data.draw(st.sampled_from([None, CacheLocation("d:1", length, ready_by=ready_by)]))
        self._apply(Commit(self.version, f"s{next(self.steps)}", append, target=target, draft=draft))

    @rule(append=TOKENS, data=st.data())
    def rollback(self, append: list[int], data: st.DataObject) -> None:
        cut = data.draw(st.integers(0, len(self.tokens)))
        self._apply(Commit(self.version, f"s{next(self.steps)}", append, truncate_to=cut))

    @precondition(lambda self: self.before_turn is None)
    @rule(append=TOKENS, data=st.data())
    def open_turn(self, append: list[int], data: st.DataObject) -> None:
        cut = data.draw(st.one_of(st.none(), st.integers(0, len(self.tokens))))
        self._apply(Commit(self.version, f"s{next(self.steps)}", append, truncate_to=cut, opens_turn=True))

    @precondition(lambda self: self.before_turn is not None)
    @rule(append=TOKENS)
    def close_turn(self, append: list[int]) -> None:
        self._apply(Commit(self.version, f"s{next(self.steps)}", append, closes_turn=True))

    @rule()
    def next_owner(self) -> None:
        """The owner goes without closing its turn (released: its lease is free at once); the
        next owner's acquire undoes that turn, or deletes the session the turn created."""
        self.run(self.store.release(self.session, self.owner))
        self.owner = f"{self.session}-{next(self.owners)}"
        record = self.run(self.store.acquire(self.session, self.owner, create=True))
        if self.before_turn is not None:
            tokens, version = self.before_turn
            self.tokens, self.version = tokens, 0 if version == 0 else self.version + 1
            if version == 0:
                self.recent = []
            self.last_was_rollback = True
        self.before_turn = None
        assert record.tokens == self.tokens and record.version == self.version

    @precondition(lambda self: bool(self.recent))
    @rule(data=st.data())
    def retry_recent(self, data: st.DataObject) -> None:
        """Re-sending any of the recent commits (a reply was lost) reports it applied, changes nothing."""
        commit = data.draw(st.sampled_from(self.recent))
        result = self.run(self.store.commit(self.session, self.owner, commit))
        assert result.outcome is CommitOutcome.ALREADY_APPLIED and result.version == self.version

    @precondition(lambda self: self.version > 0)
    @rule(append=TOKENS)
    def stale(self, append: list[int]) -> None:
        with pytest.raises(StateConflict):
            self.run(
                self.store.commit(self.session, self.owner, Commit(self.version - 1, f"s{next(self.steps)}", append))
            )

    @rule(append=TOKENS)
    def foreign_owner(self, append: list[int]) -> None:
        with pytest.raises(StateConflict):
            self.run(self.store.commit(self.session, "intruder", Commit(self.version, f"s{next(self.steps)}", append)))

    @rule(extra=st.integers(1, 3))
    def cache_beyond_committed(self, extra: int) -> None:
        target = CacheLocation("t:1", len(self.tokens) + extra)
        with pytest.raises(ValueError):
            self.run(
                self.store.commit(self.session, self.owner, Commit(self.version, f"s{next(self.steps)}", target=target))
            )

    @rule(data=st.data())
    def mark_draft_ready(self, data: st.DataObject) -> None:
        """A finished turn's background read marks the draft location held, with no lease: only
        while it is the one recorded (by value), and nothing else changes."""
        record = self.run(self.store.get(self.session))
        assert record is not None
        recorded, claims = record.draft, [CacheLocation("d:1", len(self.tokens) // 2, ready_by=1.5)]
        if recorded is not None:
            claims += [
                recorded,
                dataclasses.replace(recorded, length=recorded.length + 1),
                dataclasses.replace(recorded, ready_by=recorded.ready_by + 1),
            ]
        claim = data.draw(st.sampled_from(claims))
        marked = self.run(self.store.mark_draft_ready(self.session, claim))
        assert marked == (claim == recorded)
        after = self.run(self.store.get(self.session))
        assert after is not None
        assert after.draft == (dataclasses.replace(claim, ready_by=0.0) if marked else recorded)
        assert (after.version, after.tokens, after.target, after.owner) == (
            record.version, record.tokens, record.target, record.owner
        )  # fmt: skip

    @invariant()
    def matches_model(self) -> None:
        record = self.run(self.store.get(self.session))
        assert record is not None
        assert record.tokens == self.tokens
        assert record.version == self.version
        if not self.last_was_rollback:
            assert len(record.tokens) >= self.last_len
        for location in (record.target, record.draft):
            assert location is None or location.length <= len(record.tokens)
        self.last_len = len(record.tokens)
        if isinstance(self.store, MemoryStateStore):  # what its limit bounds, kept as it goes
            copy = len(self.before_turn[0]) if self.before_turn is not None else 0
            assert self.store.tokens_held == SESSION_TOKENS + len(self.tokens) + copy


PROPERTY_SETTINGS = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_memory_store_invariants() -> None:
    run_state_machine_as_test(
        type("MemoryStoreMachine", (StoreMachine,), {"url": "memory://"}), settings=PROPERTY_SETTINGS
    )


def test_redis_store_invariants(redis_server: RedisServer) -> None:
    machine = type("RedisStoreMachine", (StoreMachine,), {"url": redis_server.url})
    run_state_machine_as_test(machine, settings=PROPERTY_SETTINGS)


class SessionLimitMachine(RuleBasedStateMachine):
    """Two callers at a limit of 2 sessions each (--max-sessions-per-caller) making, continuing and
    closing named sessions, failing the first turn of a new one (its session deleted on release, or
    left open and undone by the next acquire), and one-shot requests (counted for nobody), in any
    order. The store refuses a new session exactly when the model's caller already holds the limit,
    and holds exactly the model's sessions."""

    url = "memory://"
    LIMIT = 2

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store: StateStore = open_store(self.url, ttl_s=60, lease_s=60, timeout_s=2, max_sessions_per_caller=2)
        self.run(self.store.start())
        run = uuid.uuid4().hex[:8]  # a Redis keeps other examples' callers and sessions
        self.callers = [f"{run}-alice", f"{run}-bob"]
        self.held: dict[str, set[str]] = {caller: set() for caller in self.callers}
        self.owners = (f"{run}-o{i}" for i in itertools.count())

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        for caller in self.callers:
            for i in range(4):
                self.run(self.store.delete(f"{caller}.{i}"))
        self.run(self.store.close())
        self.loop.close()

    def _acquire(self, caller: str | None, session: str) -> bool:
        """Acquires ``session`` for a new owner (then released); False when refused as one too many."""
        owner = next(self.owners)
        try:
            self.run(self.store.acquire(session, owner, create=True, caller=caller))
        except TooManySessions:
            return False
        self.run(self.store.release(session, owner))
        return True

    @rule(who=st.integers(0, 1), i=st.integers(0, 3))
    def make_or_continue(self, who: int, i: int) -> None:
        caller, session = self.callers[who], f"{self.callers[who]}.{i}"
        room = session in self.held[caller] or len(self.held[caller]) < self.LIMIT
        assert self._acquire(caller, session) == room
        if room:
            self.held[caller].add(session)

    @rule(who=st.integers(0, 1), i=st.integers(0, 3))
    def close(self, who: int, i: int) -> None:
        caller, session = self.callers[who], f"{self.callers[who]}.{i}"
        assert self.run(self.store.delete(session)) == (session in self.held[caller])
        self.held[caller].discard(session)

    @rule(who=st.integers(0, 1), i=st.integers(0, 3), left_open=st.booleans())
    def first_turn_fails(self, who: int, i: int, left_open: bool) -> None:
        caller, session = self.callers[who], f"{self.callers[who]}.{i}"
        if session in self.held[caller]:
            return
        owner = next(self.owners)
        try:
            self.run(self.store.acquire(session, owner, create=True, caller=caller))
        except TooManySessions:
            assert len(self.held[caller]) >= self.LIMIT
            return
        if left_open:  # its coordinator gone: the next acquire undoes the turn and the session
            self.run(self.store.commit(session, owner, Commit(0, f"{owner}:p", [1, 2], opens_turn=True)))
            self.run(self.store.release(session, owner))
            with pytest.raises(SessionNotFound):
                self.run(self.store.acquire(session, next(self.owners), create=False, caller=caller))
        else:
            self.run(self.store.release(session, owner, delete=True))

    @rule()
    def one_shot(self) -> None:
        session, owner = f"oneshot-{uuid.uuid4().hex[:8]}", next(self.owners)
        self.run(self.store.acquire(session, owner, create=True))
        self.run(self.store.release(session, owner, delete=True))

    @invariant()
    def holds_the_model_s_sessions(self) -> None:
        for caller in self.callers:
            for i in range(4):
                session = f"{caller}.{i}"
                assert (self.run(self.store.get(session)) is not None) == (session in self.held[caller])


def test_memory_store_limits_sessions_per_caller() -> None:
    run_state_machine_as_test(SessionLimitMachine, settings=PROPERTY_SETTINGS)


def test_redis_store_limits_sessions_per_caller(redis_server: RedisServer) -> None:
    machine = type("RedisSessionLimitMachine", (SessionLimitMachine,), {"url": redis_server.url})
    run_state_machine_as_test(machine, settings=PROPERTY_SETTINGS)


def test_concurrent_committers_in_two_processes(redis_server: RedisServer) -> None:
    """2 OS processes x 30 tasks race on one session; every step applies exactly once."""
    session = f"race-{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        store = open_store(redis_server.url, ttl_s=60, lease_s=60, timeout_s=2)
        await store.start()
        await store.acquire(session, "owner", create=True)
        await store.close()

    asyncio.run(create())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.committer_proc", redis_server.url, session, str(base), "30"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for base in (0, 1000)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    applied = sum(int(out.split()[0]) for out in outputs)
    already = sum(int(out.split()[1]) for out in outputs)

    async def read() -> list[int]:
        store = open_store(redis_server.url, ttl_s=60, lease_s=60, timeout_s=2)
        await store.start()
        record = await store.get(session)
        await store.close()
        assert record is not None and record.version == 60
        return record.tokens

    tokens = asyncio.run(read())
    assert sorted(tokens) == [*range(30), *range(1000, 1030)]
    assert applied == 60  # each step applied exactly once, whatever the retries
    assert already > 0  # re-sends inside the recent-step window were recognised as applied
