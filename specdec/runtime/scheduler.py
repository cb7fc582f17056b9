"""The model thread of a worker: a step scheduler that batches requests' forward passes.

A request is a *job*: a generator that yields ``Extend`` steps (run these tokens through the model
on top of a session's cache, give me the last N logits) and finally returns its result. Each
scheduler iteration takes the pending step of every active job and runs them as one batched
forward pass (continuous batching: new requests join at the next step). Short steps (decoding,
verification blocks) are batched together; long ones (prefills) run one at a time, so that a
long prompt does not pad every row of a batch, and a chunk at a time (chunked prefill): each
iteration runs the short steps, then the next chunk of one long step, so a long prompt holds the
other sessions up for one chunk's pass at most, not for its whole prefill.

Model compute therefore never runs on the asyncio event loop, and there is one thread that
touches the model and the caches. Jobs of one session run one after another.

A session's next step comes a round trip after its job ended (the reply to the coordinator, its
next request): sessions that came back while a pass ran make the next pass without those of that
pass, and two sessions then take turns, a pass each, never sharing one. So before a pass of short
steps the thread waits, a little, for the sessions whose jobs just ended and whose round trip
(measured) ends within the wait (``_gather``): at most ``batch_wait_s`` or half a short pass.
Workers that take turns on one host's cores (``HostLock``) do not wait: their bursts batch the
sessions, and a session's next step may need the other worker's turn.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import os
import queue
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import structlog
import torch

from specdec.averages import ewma
from specdec.runtime.kvcache import EarlierLogits, SessionCache, SessionCaches

log = structlog.get_logger(__name__)
T = TypeVar("T")

SHORT_STEP_TOKENS = 32  # steps up to this many tokens are batched together
_WEIGHT = 0.1  # a new measure's weight in the moving averages of passes and round trips (0 = none yet)
# A batched pass pads every row's cache to its longest row's and copies them all: rows this short
# batch freely; a longer row only with rows at least half its length
PAD_SLACK_TOKENS = 2048


class ModelFault(Exception):
    """The model's forward pass raised: a genuine model/device fault (the worker must not go on
    serving from a possibly corrupt state). Exceptions in a job's own code are not wrapped."""


@dataclass
class ComputeMeter:
    """A job's share of the forward passes it took part in (a pass of n rows counts 1/n to
    each), in milliseconds. Unlike wall time it leaves out waiting for the model thread, the
    batch and the host lock, so costs measured under load stay comparable."""

    ms: float = 0.0
    tokens: int = 0  # tokens the job ran through the model


@dataclass(frozen=True)
class Extend:
    """A job's step: run ``token_ids`` after ``entry``'s cache; send back the last ``num_logits`` logits."""

    entry: SessionCache
    token_ids: list[int]
    num_logits: int
    meter: ComputeMeter | None = None
    earlier: EarlierLogits | None = None  # rows before the last num_logits, scored a chunk at a time (runs alone)


Job = Generator[Extend, torch.Tensor, T]


@dataclass
class _Task(Generic[T]):
    session: str
    start: Callable[[], Job[T]] | None
    call: Callable[[], T] | None
    future: Future[T] = field(default_factory=Future)
    job: Job[T] | None = None
    step: Extend | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)  # when its caller sent it


def _settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Resolves a future unless the awaiting side cancelled it, also while this runs: the event
    loop's thread cancels the future of a request its client cancelled at any moment."""
    try:
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        elif exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled (or settled) before this could
        pass


class HostLock:
    """An exclusive lock on a file shared by the workers of one CPU host.

    Two model processes computing at once on the same cores oversubscribe them (measured on a
    2-core host: a 1.5B verify pass went from 0.73 s to 1.3-2.1 s with a 0.5B draft running beside
    it). So co-located workers take turns: a worker holds the lock while it has work, for up to
    ``max_hold_s`` of consecutive passes (a draft's few short steps for a whole block), then lets
    the other have it. Taking turns in bursts also batches sessions: a burst drafts for those
    waiting for drafts, the next verifies the blocks that are ready. Under load they drift out of
    phase (16 requests at once on a 2-core host: 3.9 sessions a verify pass; docs/benchmarks.md, Under load).
    """

    def __init__(self, path: str | None, max_hold_s: float = 0.6) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path else None
        self._max_hold_s = max_hold_s
        self._since: float | None = None

    def acquire(self) -> None:
        """Takes the lock (waiting for the other worker's burst) unless this worker holds it."""
        if self._fd is not None and self._since is None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._since = time.monotonic()

    def release(self) -> None:
        if self._fd is not None and self._since is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._since = None
            time.sleep(0)  # let a waiting process take the lock before this thread asks again

    @property
    def shared(self) -> bool:
        """Whether this worker takes turns with another on the host (a lock file was given)."""
        return self._fd is not None

    def pass_done(self) -> None:
        """Ends the burst once it has lasted ``max_hold_s``."""
        if self._since is not None and time.monotonic() - self._since >= self._max_hold_s:
            self.release()


class StepScheduler:
    """Owns the model thread; see the module docstring."""

    def __init__(self, max_batch: int, host_lock: HostLock | None = None, batch_wait_s: float = 0.0) -> None:
        self._max_batch = max_batch
        self._chunk_tokens = 0  # a long step's tokens per pass (0 = all at once); set by attach()
        self._host_lock = host_lock or HostLock(None)
        self._batch_wait_s = batch_wait_s
        self._waits = batch_wait_s > 0 and not self._host_lock.shared  # else none of the wait's state is kept
        self._ended: dict[str, float] = {}  # sessions whose job ended and no next one came yet: when
        self._round_trip_s = 0.0  # from a job's end to its session's next job (moving average; 0 = none yet)
        self._pass_s = 0.0  # a pass of short steps (moving average)
        self._inbox: queue.SimpleQueue[_Task[Any] | None] = queue.SimpleQueue()
        self._waiting: dict[str, collections.deque[_Task[Any]]] = collections.defaultdict(collections.deque)
        self._active: dict[str, _Task[Any]] = {}
        self._caches: SessionCaches | None = None
        self._failed: ModelFault | None = None  # what ended the model thread, if anything did
        self._thread = threading.Thread(target=self._run, name="model", daemon=True)
        self._thread.start()
        self.batched_forwards = 0
        self.batched_requests = 0

    def attach(self, caches: SessionCaches, chunk_tokens: int = 0) -> None:
        """Gives the model thread its caches, and how many tokens of a long step (a prefill) one
        pass runs (0 = the whole step in one pass)."""
        self._chunk_tokens = chunk_tokens
        self._caches = caches

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a plain function in the model thread, between steps."""
        return await self._submit(_Task(session="", start=None, call=lambda: fn(*args)))

    async def run(self, session: str, start: Callable[[], Job[T]]) -> T:
        """Runs a job for ``session``; if the caller is cancelled, the job is closed at its next step."""
        return await self._submit(_Task(session=session, start=start, call=None))

    async def _submit(self, task: _Task[T]) -> T:
        self._inbox.put(task)
        if self._failed is not None:  # the thread may have drained the inbox before this put
            _settle(task.future, exc=self._failed)
        try:
            return await asyncio.wrap_future(task.future)
        except asyncio.CancelledError:
            task.cancelled = True
            raise

    def stop(self) -> None:
        self._inbox.put(None)

    # --- model thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug of this thread's own: no step may wait for it forever
            log.exception("model_thread_failed")
            fault = ModelFault(f"the model thread failed: {exc!r}")
            fault.__cause__ = exc
            self._failed = fault
            self._host_lock.release()
            tasks = [*self._active.values(), *(t for waiting in self._waiting.values() for t in waiting)]
            while True:
                try:
                    task = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    tasks.append(task)
            for task in tasks:
                _settle(task.future, exc=fault)

    def _loop(self) -> None:
        while True:
            if not self._active:
                self._host_lock.release()  # idle: never block on the inbox holding the host lock
            if not self._take_new(block=not self._active):
                self._host_lock.release()
                return
            short = [t for t in self._active.values() if t.step and _batchable(t.step)]
            if self._waits and short and len(short) < self._max_batch:
                if not self._gather():
                    self._host_lock.release()
                    return
                short = [t for t in self._active.values() if t.step and _batchable(t.step)]
            long = [t for t in self._active.values() if t.step and not _batchable(t.step)]
            for batch in pad_bounded(short[: self._max_batch]):
                began = time.perf_counter()
                self._forward(batch)  # timed with the jobs' code after it, which on a GPU waits for the pass
                if self._waits:
                    self._pass_s = ewma(self._pass_s or None, time.perf_counter() - began, _WEIGHT)
            if long:
                self._forward_part(long[0])

    def _gather(self) -> bool:
        """Before a pass of short steps: waits for the sessions expected back within the wait
        (their jobs ended, a round trip ago or less, with the measured round trip) to send their
        next steps, so that they share the pass: at most ``batch_wait_s`` or half a short pass,
        and two round trips after their ends. False when stop() was called. A session that did
        not come in time is not waited for again until its next job ends; one whose round trip
        is longer than the wait (a draft's block before its next verify) is not waited for."""
        now = time.monotonic()
        kept = 2 * self._pass_s if self._pass_s else 1.0  # later than this a return is not a round trip
        for session, ended in list(self._ended.items()):
            if now - ended > kept:
                del self._ended[session]
        wait_s = min(self._batch_wait_s, self._pass_s / 2)
        trip = self._round_trip_s
        # due: expected back (a round trip after its end) within the wait, and not overdue
        due = [s for s, ended in self._ended.items() if ended + trip <= now + wait_s and now - ended <= 2 * trip]
        if not due or not wait_s:
            return True
        deadline = min(now + wait_s, max(self._ended[s] for s in due) + 2 * trip)
        while any(s in self._ended for s in due) and (left := deadline - time.monotonic()) > 0:
            if not self._take_new(block=True, timeout_s=left):
                return False
        for session in due:  # not waited for again until its next job ends
            self._ended.pop(session, None)
        return True

    def _take_new(self, block: bool, timeout_s: float | None = None) -> bool:
        """Moves submitted tasks in; False when stop() was called."""
        while True:
            try:
                task = self._inbox.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return True
            block = False
            if task is None:
                return False
            if task.call is not None:
                self._run_call(task)
            else:
                self._came_back(task.session, task.submitted)
                self._waiting[task.session].append(task)
                self._activate(task.session)

    def _came_back(self, session: str, submitted: float) -> None:
        """Measures a session's round trip from its last job's end to this one's submission (not
        to when this thread saw it: it may have been busy with a pass)."""
        ended = self._ended.pop(session, None)
        if ended is None:
            return
        trip = max(submitted - ended, 0.0)
        if self._pass_s and trip > 2 * self._pass_s:  # a client's pause, not a round trip
            return
        self._round_trip_s = ewma(self._round_trip_s or None, trip, _WEIGHT)

    def _run_call(self, task: _Task[Any]) -> None:
        assert task.call is not None
        try:
            _settle(task.future, task.call())
        except BaseException as exc:  # handed to the awaiting coroutine
            _settle(task.future, exc=exc)

    def _activate(self, session: str) -> None:
        """Starts the next waiting job of ``session`` if none of its jobs is active."""
        waiting = self._waiting.get(session)
        while waiting and session not in self._active:
            task = waiting.popleft()
            if task.cancelled:
                _settle(task.future, exc=asyncio.CancelledError())
                continue
            assert task.start is not None
            try:
                task.job = task.start()
            except BaseException as exc:  # handed to the awaiting coroutine
                _settle(task.future, exc=exc)
                continue
            self._active[session] = task
            self._advance(task, None)
        if waiting is not None and not waiting:
            self._waiting.pop(session, None)

    def _advance(self, task: _Task[Any], logits: torch.Tensor | None) -> None:
        """Sends ``logits`` into the job; records its next step or finishes it."""
        assert task.job is not None
        try:
            if task.cancelled:
                task.job.close()
                raise asyncio.CancelledError
            task.step = task.job.send(logits)  # type: ignore[arg-type]
            return
        except StopIteration as done:
            _settle(task.future, done.value)
            if task.session and self._waits:
                self._ended[task.session] = time.monotonic()
        except BaseException as exc:  # handed to the awaiting coroutine
            _settle(task.future, exc=exc)
        self._active.pop(task.session, None)
        self._activate(task.session)

    def _forward_part(self, task: _Task[Any]) -> None:
        """Runs a long step's next chunk; the job gets its logits once the last chunk has run.
        A job cancelled between chunks is closed there (its cache holds the chunks run)."""
        assert task.step is not None
        if task.cancelled:
            task.step = None
            self._advance(task, None)
            return
        head, rest = split_step(task.step, self._chunk_tokens)
        if rest is None:
            self._forward([task])
        else:
            self._forward([task], [head], rest)

    def _forward(self, tasks: list[_Task[Any]], parts: list[Extend] | None = None, rest: Extend | None = None) -> None:
        """One pass of the tasks' steps (or of ``parts`` of them: a long step's first chunk, whose
        ``rest`` becomes the task's step instead of the job going on)."""
        assert self._caches is not None
        steps = parts if parts is not None else [t.step for t in tasks if t.step is not None]
        try:
            self._host_lock.acquire()
            began = time.perf_counter()
            if steps[0].earlier is not None:  # never batched
                one = steps[0]
                results = [self._caches.extend(one.entry, one.token_ids, one.num_logits, one.earlier)]
            else:
                results = self._caches.extend_many([(s.entry, s.token_ids, s.num_logits) for s in steps])
            share_ms = (time.perf_counter() - began) * 1000 / len(steps)
            self._host_lock.pass_done()
        except BaseException as exc:  # every job in the batch fails with it
            fault = ModelFault(f"forward pass failed: {exc!r}")
            fault.__cause__ = exc
            for task in tasks:
                task.step = None
                _settle(task.future, exc=fault)
                self._active.pop(task.session, None)
            for task in tasks:
                self._activate(task.session)
            return
        for step in steps:
            if step.meter is not None:
                step.meter.ms += share_ms
                step.meter.tokens += len(step.token_ids)
        if len(tasks) > 1:
            self.batched_forwards += 1
            self.batched_requests += len(tasks)
        if rest is not None:
            tasks[0].step = rest
            return
        for task, logits in zip(tasks, results, strict=True):
            task.step = None
            self._advance(task, logits)


def _batchable(step: Extend) -> bool:
    """Short steps share a forward pass; long ones (prefills) and steps scoring earlier rows run alone."""
    return len(step.token_ids) <= SHORT_STEP_TOKENS and step.earlier is None


def pad_bounded(tasks: list[_Task[Any]]) -> list[list[_Task[Any]]]:
    """Short steps cut into batched passes, longest row first: a row joins a pass whose longest
    row has at most PAD_SLACK_TOKENS, or at most twice the row's. A pass then pads no row to more
    than twice its own length (beyond the slack), and a session with a long history no longer has
    every row of a pass padded to it (16 rows beside a 30,000-token cache: 480,000 positions of
    keys and values copied for one pass, 25.6 GiB for Qwen2.5 1.5B in float32)."""
    passes: list[list[_Task[Any]]] = []
    for task in sorted(tasks, key=_row_tokens, reverse=True):
        longest = _row_tokens(passes[-1][0]) if passes else 0
        if passes and (longest <= PAD_SLACK_TOKENS or 2 * _row_tokens(task) >= longest):
            passes[-1].append(task)
        else:
            passes.append([task])
    return passes


def _row_tokens(task: _Task[Any]) -> int:
    """A batched row's length: its session's cache and its step."""
    assert task.step is not None
    return len(task.step.entry.tokens) + len(task.step.token_ids)


def split_step(step: Extend, chunk_tokens: int) -> tuple[Extend, Extend | None]:
    """``step`` cut into its first ``chunk_tokens`` tokens and the rest (None: it fits in one
    pass). The first part asks for no logits but its share of ``step.earlier``'s rows (they come
    in order), the rest for the step's last ``num_logits`` logits and the earlier rows left."""
    count = len(step.token_ids)
    head_len = min(chunk_tokens, count - step.num_logits)  # the logits the job waits for come last
    if chunk_tokens <= 0 or count <= chunk_tokens or head_len <= 0:
        return step, None
    rows = step.earlier.rows if step.earlier is not None else 0
    head_rows = max(0, head_len - (count - step.num_logits - rows))  # earlier rows end the head
    head_earlier = rest_earlier = None
    if step.earlier is not None:
        consume = step.earlier.consume
        head_earlier = EarlierLogits(head_rows, consume) if head_rows else None
        rest_earlier = EarlierLogits(rows - head_rows, consume) if rows > head_rows else None
    head = Extend(step.entry, step.token_ids[:head_len], 0, step.meter, head_earlier)
    rest = Extend(step.entry, step.token_ids[head_len:], step.num_logits, step.meter, rest_earlier)
    return head, rest
