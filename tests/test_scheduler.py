"""The step scheduler: batched passes, each job's compute share, and the host lock."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specdec.runtime import scheduler as scheduler_module
from specdec.runtime.scheduler import (
    ComputeMeter,
    Extend,
    HostLock,
    Job,
    ModelFault,
    StepScheduler,
    _row_tokens,
    _settle,
    _Task,
    pad_bounded,
)

_PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    print("held")
else:
    print("free")
"""


def _probe(path: Path) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, check=True).stdout


def test_another_process_waits_while_a_forward_holds_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "cpu.lock"
    lock = HostLock(str(path))
    lock.acquire()
    assert _probe(path).strip() == "held"
    lock.release()
    assert _probe(path).strip() == "free"


def test_no_file_means_no_locking() -> None:
    lock = HostLock(None)
    lock.acquire()
    lock.acquire()  # re-entrant because it does nothing
    lock.pass_done()
    lock.release()


class _SlowCaches:
    """Stands in for SessionCaches in this unit test: every forward pass takes 0.2 s; the first
    one waits until ``gate`` is set, so that the test decides what is queued behind it."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.gate = threading.Event()

    def extend_many(self, ops: Sequence[tuple[Any, Sequence[int], int]]) -> list[torch.Tensor]:
        self.gate.wait(10)
        self.batches.append(len(ops))
        time.sleep(0.2)
        return [torch.zeros(n, 4) for _, _, n in ops]


_NO_CACHE = SimpleNamespace(tokens=[])  # stands in for a session's cache: nothing cached


def _job(meter: ComputeMeter, steps: int) -> Job[float]:
    for _ in range(steps):
        yield Extend(_NO_CACHE, [1], 1, meter)  # type: ignore[arg-type]
    return meter.ms


async def _queued(scheduler: StepScheduler, count: int) -> None:
    """Waits until the model thread holds ``count`` jobs (they then join the next pass together)."""
    while len(scheduler._active) + sum(len(w) for w in scheduler._waiting.values()) < count:  # noqa: ASYNC110
        await asyncio.sleep(0.005)  # the model thread's state: there is no event to await


@pytest.mark.asyncio
async def test_jobs_in_one_pass_share_its_time_and_waiting_is_not_counted() -> None:
    scheduler = StepScheduler(max_batch=8)
    caches = _SlowCaches()
    scheduler.attach(caches)  # type: ignore[arg-type]
    try:
        blocker = asyncio.ensure_future(scheduler.run("blocker", lambda: _job(ComputeMeter(), 1)))
        await _queued(scheduler, 1)  # the blocker's pass waits at the gate
        meters = [ComputeMeter() for _ in range(4)]
        jobs = [asyncio.ensure_future(scheduler.run(f"s{i}", lambda m=m: _job(m, 2))) for i, m in enumerate(meters)]
        while scheduler._inbox.qsize() < 4:  # noqa: ASYNC110 (all four submitted before the gate opens)
            await asyncio.sleep(0.005)
        caches.gate.set()
        await blocker
        results = await asyncio.gather(*jobs)
        # The blocker's pass, then two passes of four rows: each of the four jobs is charged
        # 2 x 0.2 s / 4 = 100 ms, not the 0.6 s it waited.
        assert caches.batches == [1, 4, 4]
        assert all(ms == pytest.approx(100, abs=40) for ms in results)
        # The same session's jobs run one after the other: the second one is charged its own pass only.
        first, second = ComputeMeter(), ComputeMeter()
        await asyncio.gather(scheduler.run("s", lambda: _job(first, 1)), scheduler.run("s", lambda: _job(second, 1)))
        assert caches.batches[-2:] == [1, 1]
        assert first.ms == pytest.approx(200, abs=60) and second.ms == pytest.approx(200, abs=60)
    finally:
        scheduler.stop()


def test_a_worker_keeps_the_host_lock_for_a_burst_then_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "cpu.lock"
    lock = HostLock(str(path), max_hold_s=0.3)
    lock.acquire()
    lock.pass_done()  # a short pass: the burst goes on
    assert _probe(path).strip() == "held"
    time.sleep(0.35)
    lock.pass_done()  # the burst has lasted max_hold_s: the other worker gets its turn
    assert _probe(path).strip() == "free"
    lock.release()  # idempotent


class _RecordingCaches(_SlowCaches):
    """Like _SlowCaches, with passes of 0.02 s, recording the tokens of each row of each pass."""

    def __init__(self) -> None:
        super().__init__()
        self.passes: list[list[int]] = []

    def extend(self, entry: Any, token_ids: Sequence[int], num_logits: int, earlier: Any = None) -> torch.Tensor:
        return self.extend_many([(entry, token_ids, num_logits)])[0]

    def extend_many(self, ops: Sequence[tuple[Any, Sequence[int], int]]) -> list[torch.Tensor]:
        self.gate.wait(10)
        self.passes.append(sorted(len(ids) for _, ids, _ in ops))
        time.sleep(0.02)
        return [torch.zeros(n, 4) for _, _, n in ops]


def _prefill(tokens: int, closed: list[bool]) -> Job[int]:
    try:
        logits = yield Extend(_NO_CACHE, [1] * tokens, 1)  # type: ignore[arg-type]
        return logits.shape[0]
    finally:
        closed.append(True)


@pytest.mark.asyncio
async def test_a_long_step_runs_a_chunk_at_a_time_between_the_short_steps() -> None:
    """Chunked prefill: a 100-token step with chunks of 32 gives way to a decoding session's
    one-token steps after each chunk; its last 4 tokens, short, join their batch."""
    scheduler = StepScheduler(max_batch=8)
    caches = _RecordingCaches()
    scheduler.attach(caches, chunk_tokens=32)  # type: ignore[arg-type]
    try:
        blocker = asyncio.ensure_future(scheduler.run("blocker", lambda: _job(ComputeMeter(), 1)))
        await _queued(scheduler, 1)
        closed: list[bool] = []
        decoding = asyncio.ensure_future(scheduler.run("decoding", lambda: _job(ComputeMeter(), 5)))
        prefill = asyncio.ensure_future(scheduler.run("prefill", lambda: _prefill(100, closed)))
        while scheduler._inbox.qsize() < 2:  # noqa: ASYNC110 (both submitted before the gate opens)
            await asyncio.sleep(0.005)
        caches.gate.set()
        await asyncio.gather(blocker, decoding)
        assert await prefill == 1 and closed == [True]
        assert caches.passes == [[1], [1], [32], [1], [32], [1], [32], [1, 4], [1]]
    finally:
        scheduler.stop()


@pytest.mark.asyncio
async def test_a_prefill_whose_caller_is_gone_stops_at_the_next_chunk() -> None:
    scheduler = StepScheduler(max_batch=8)
    caches = _RecordingCaches()
    caches.gate.set()
    scheduler.attach(caches, chunk_tokens=32)  # type: ignore[arg-type]
    try:
        closed: list[bool] = []
        prefill = asyncio.ensure_future(scheduler.run("prefill", lambda: _prefill(32 * 100, closed)))
        while len(caches.passes) < 2:  # noqa: ASYNC110 (the model thread's state: no event to await)
            await asyncio.sleep(0.005)
        prefill.cancel()
        with pytest.raises(asyncio.CancelledError):
            await prefill
        while not closed:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        assert 2 <= len(caches.passes) <= 4  # not the 100 chunks of the whole prompt
    finally:
        scheduler.stop()


@pytest.mark.parametrize(
    ("cached", "passes"),
    [
        ([12_000] + [4] * 12, [[12_000], [4] * 12]),  # a long history is not every row's padding
        ([300] + [150] * 15, [[300] + [150] * 15]),  # short rows batch freely
        ([3_000, 1_600, 1_400, 5], [[3_000, 1_600], [1_400, 5]]),  # beyond the slack: within 2x of the longest
        ([9_000, 8_000, 4_600], [[9_000, 8_000, 4_600]]),
    ],
)
def test_a_batched_pass_pads_no_row_to_far_more_than_its_own_length(cached: list[int], passes: list[list[int]]) -> None:
    tasks = [
        _Task(f"s{i}", None, None, step=Extend(SimpleNamespace(tokens=[0] * (n - 1)), [1], 1))  # type: ignore[arg-type]
        for i, n in enumerate(cached)
    ]
    assert [[_row_tokens(t) for t in batch] for batch in pad_bounded(tasks)] == passes


class _TimedCaches:
    """Stands in for SessionCaches in this unit test: every forward pass takes ``pass_s``; records
    each pass's rows and times."""

    def __init__(self, pass_s: float) -> None:
        self.batches: list[int] = []
        self.pass_s = pass_s
        self.times: list[tuple[float, float]] = []  # each pass's start and end

    def extend_many(self, ops: Sequence[tuple[Any, Sequence[int], int]]) -> list[torch.Tensor]:
        self.batches.append(len(ops))
        began = time.monotonic()
        time.sleep(self.pass_s)
        self.times.append((began, time.monotonic()))
        return [torch.zeros(n, 4) for _, _, n in ops]


async def _rounds(scheduler: StepScheduler, session: str, rounds: int, round_trip_s: float, start_s: float) -> None:
    """A session's rounds as a coordinator sends them, from ``start_s``: a one-pass job, then the
    next a round trip after its reply."""
    await asyncio.sleep(start_s)
    for _ in range(rounds):
        await scheduler.run(session, lambda: _job(ComputeMeter(), 1))
        await asyncio.sleep(round_trip_s)


async def _two_sessions(wait_s: float, rounds: int, round_trip_s: float) -> _TimedCaches:
    """Two sessions' rounds through a scheduler waiting at most ``wait_s``, passes of 60 ms, the
    second session starting half a pass after the first; returns the passes."""
    scheduler = StepScheduler(max_batch=8, batch_wait_s=wait_s)
    caches = _TimedCaches(0.06)
    scheduler.attach(caches)  # type: ignore[arg-type]
    try:
        await asyncio.gather(
            _rounds(scheduler, "a", rounds, round_trip_s, 0), _rounds(scheduler, "b", rounds, round_trip_s, 0.03)
        )
    finally:
        scheduler.stop()
    return caches


@pytest.mark.asyncio
@pytest.mark.parametrize("wait_s", [0.0, 0.05])
async def test_sessions_a_round_trip_apart_share_passes_where_the_scheduler_waits_for_them(wait_s: float) -> None:
    """Two sessions whose next steps come 10 ms after their jobs end, passes of 60 ms, the second
    session starting half a pass after the first: without the wait each one's step makes the pass
    after the other's, and they take turns, a pass each (what the target worker did: on an H200 2
    sessions decoded no faster than one); waiting for the session whose job just ended puts both
    in every pass after the first few."""
    caches = await _two_sessions(wait_s, 10, 0.01)
    assert sum(caches.batches) == 20
    if wait_s:
        assert caches.batches.count(2) >= 7, caches.batches
    else:
        assert caches.batches.count(2) <= 2, caches.batches


@pytest.mark.asyncio
async def test_sessions_whose_round_trip_is_longer_than_the_wait_are_not_waited_for() -> None:
    """Round trips of 40 ms (a draft's block between a session's verifies), passes of 60 ms, a
    wait of at most 20 ms: a session is not back within the wait, so no pass waits for one (each
    starts as the one before ends: the other session's step is there)."""
    caches = await _two_sessions(0.02, 8, 0.04)
    gaps = [began - ended for (_, ended), (began, _) in zip(caches.times, caches.times[1:], strict=False)]
    assert statistics.median(gaps) < 0.008, gaps  # a wait for a session would leave 20 ms between passes


class _CancelledWhileSettled(Future):  # type: ignore[type-arg]
    """A future its awaiting side cancels (from the event loop's thread) just after the model
    thread found it pending and before it set it: the moment ``_settle``'s check cannot see."""

    def set_result(self, result: object) -> None:
        self.cancel()
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self.cancel()
        super().set_exception(exception)


@pytest.mark.parametrize("outcome", ["result", "exception"])
def test_a_future_cancelled_while_it_is_settled_stays_cancelled(outcome: str) -> None:
    """A client that cancels its request cancels the step's future from the event loop's thread
    at any moment; one cancelled between the model thread's check and its set_result raised
    InvalidStateError in the model thread, which ended it (found by the native fuzz test in CI:
    the target's model thread died, every later request hung until its deadline)."""
    future = _CancelledWhileSettled()
    _settle(future, 1) if outcome == "result" else _settle(future, exc=ValueError("its own error"))
    assert future.cancelled()


def test_a_model_thread_that_fails_fails_every_step_as_a_model_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception the model thread does not expect (outside a pass and a job's own code) ends
    it: the steps waiting then, and every one submitted after, fail as a ModelFault (the worker's
    crash policy: it leaves service and is restarted) instead of waiting forever."""
    broken = iter([RuntimeError("the model thread's own bug")])

    def pad_once(tasks: list[Any]) -> list[list[Any]]:
        raise next(broken)

    monkeypatch.setattr(scheduler_module, "pad_bounded", pad_once)
    scheduler = StepScheduler(max_batch=4)
    scheduler.attach(SimpleNamespace(extend_many=lambda rows: [torch.zeros(1, 3) for _ in rows]))  # type: ignore[arg-type]

    def job() -> Generator[Extend, torch.Tensor, int]:
        yield Extend(_NO_CACHE, [1], 1)  # type: ignore[arg-type]
        return 1

    async def main() -> tuple[BaseException, BaseException]:
        first = await asyncio.wait_for(asyncio.gather(scheduler.run("a", job), return_exceptions=True), 10)
        later = await asyncio.wait_for(asyncio.gather(scheduler.run("b", job), return_exceptions=True), 10)
        return first[0], later[0]

    first, later = asyncio.run(main())
    assert isinstance(first, ModelFault) and "the model thread's own bug" in str(first)
    assert isinstance(later, ModelFault)
