"""pytest plugin: tests marked ``alone`` run while no other test runs, under pytest-xdist too.

The suite runs on two xdist workers (pyproject's addopts): most tests wait on service processes,
sockets and clocks, so two at a time fill the idle cores. Some must not share the host: the
chi-square tests keep both cores busy on their own (``tests.helpers.in_two_processes``), and
tests that measure timing (adaptive K, stalls, chunked prefill) would measure the other test.

Two lock files in the run's shared temporary directory, one per run: every test passes through
a gate, then holds the room shared (other tests) or exclusive (``alone``). An ``alone`` test
holds the gate while it waits for the room, so the other worker's next test waits behind it
instead of taking the room again and again (flock makes no promise of order). An ``alone`` test
whose worker runs another one next keeps the room for it: handing it back between them let the
other worker run one test in every gap while this one waited, so a file of ``alone`` tests and the
other worker's tests ran one at a time, all of them. Without xdist (``-n 0``) tests run one at a
time anyway and nothing is locked.
"""

from __future__ import annotations

import fcntl
from collections.abc import Generator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: runs while no other test runs (see tests/alone.py)")


@contextmanager
def locked(path: Path, mode: int) -> Iterator[None]:
    """Holds an flock of ``mode`` on ``path`` (created if missing) for the ``with`` block."""
    with path.open("a") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_kept: ExitStack | None = None  # the room an ``alone`` test kept for the next one (this worker's)


def _alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@contextmanager
def _turn(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _kept
    if not hasattr(item.config, "workerinput"):  # not an xdist worker: nothing else runs
        yield
        return
    shared = Path(item.config.option.basetemp).parent  # each worker's basetemp is <run's>/gwN
    alone = _alone(item)
    held, _kept = _kept, None
    if held is None:
        held = ExitStack()
        with locked(shared / "alone-gate.lock", fcntl.LOCK_EX):
            if alone:
                held.enter_context(locked(shared / "alone-room.lock", fcntl.LOCK_EX))
        if not alone:
            held.enter_context(locked(shared / "alone-room.lock", fcntl.LOCK_SH))
    try:
        yield
    finally:
        if alone and _alone(nextitem):  # (xdist runs an item once it knows the next, or that none comes)
            _kept = held
        else:
            held.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Setup, call and teardown of ``item`` all run inside its turn."""
    with _turn(item, nextitem):
        return (yield)
