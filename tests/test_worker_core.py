"""WorkerCore: a job abandoned by its caller leaves no cache behind when it made one."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from prometheus_client import CollectorRegistry

from specdec.runtime.scheduler import Extend, Job
from specdec.serving.server import ServerControl
from specdec.serving.settings import ModelWorkerSettings
from specdec.serving.worker import WorkerCore
from tests.tiny_models import TinyModels


def _job(core: WorkerCore, session: str, started: threading.Event | None = None) -> Job[None]:
    """A job as the workers' jobs begin: it makes the session's cache, then runs steps."""
    entry = core.caches.sync(session, 0, 0)
    if started is not None:
        started.set()
    for token in range(3, 40):
        yield Extend(entry, [token] * 8, 1)


async def _abandon(core: WorkerCore, session: str) -> None:
    """Starts a job, waits until it has made its cache, then cancels it (its caller left)."""
    started = threading.Event()
    task = asyncio.create_task(core.run(session, lambda: _job(core, session, started)))
    assert await asyncio.to_thread(started.wait, 30)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_a_job_that_made_the_cache_and_was_abandoned_frees_it(tiny_models: TinyModels) -> None:
    """The coordinator releases a finished turn's caches while a late request of that turn (sent
    before, arriving after) is still to start: the late request makes a fresh cache, then its
    cancellation arrives. That cache must go too, not linger until the idle timeout."""

    async def scenario() -> tuple[bool, bool]:
        core = WorkerCore(ModelWorkerSettings(model=str(tiny_models.target), device="cpu"), ServerControl(),
                          CollectorRegistry())  # fmt: skip
        await core.load()
        try:
            await core.release("late")  # the release overtakes the request
            await _abandon(core, "late")
            # a cache that existed before the abandoned job is the session's own: it stays
            await core.run("kept", lambda: _job(core, "kept"))
            await _abandon(core, "kept")
            await core.call(lambda: None)  # the model thread has run what was queued before
            return "late" in core.caches, "kept" in core.caches
        finally:
            core.close()

    late, kept = asyncio.run(scenario())
    assert not late and kept
