"""The test helpers' own checks: work split over two processes, tests that run alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import in_two_processes

PLANTED = {"value": 0}


def test_both_halves_come_back_in_order_and_the_child_sees_what_the_test_set_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(PLANTED, "value", 7)  # as a planted bug is: set before the split

    def work(which: range) -> tuple[list[int], int, int]:
        return [i * PLANTED["value"] for i in which], os.getpid(), which.start

    (first, first_pid, first_start), (second, second_pid, second_start) = in_two_processes(work, 5)
    assert (first, first_start) == ([0, 7], 0)
    assert (second, second_start) == ([14, 21, 28], 2)
    assert second_pid == os.getpid() != first_pid  # the first half ran in another process


def test_a_failing_child_fails_the_call(capfd: pytest.CaptureFixture[str]) -> None:
    def work(which: range) -> int:
        if which.start == 0:
            raise ValueError("planted failure in the child")
        return len(which)

    with pytest.raises(AssertionError, match="forked half"):
        in_two_processes(work, 4)
    assert "planted failure in the child" in capfd.readouterr().err


ROOT = Path(__file__).resolve().parents[1]

_TIMED_TESTS = """
import os, time
import pytest

def _work(name):
    began = time.monotonic()
    time.sleep(0.8)
    with open(os.environ["TIMES_FILE"], "a") as out:
        out.write(f"{name} {began} {time.monotonic()}\\n")

@pytest.mark.parametrize("i", range(6))
def test_shared(i):
    _work(f"shared{i}")

@pytest.mark.alone
@pytest.mark.parametrize("i", range(3))
def test_alone(i):
    _work(f"alone{i}")
"""


def _timed_run(tmp_path: Path, plugin: bool) -> list[tuple[str, float, float]]:
    """Runs 9 sleeping tests, 3 of them marked ``alone``, on two xdist workers; their times."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers = alone: see tests/alone.py\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.alone"]\n' if plugin else "")
    (tmp_path / "test_timed.py").write_text(_TIMED_TESTS)
    times = tmp_path / "times.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIMES_FILE": str(times)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "load"]
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return [(name, float(a), float(b)) for name, a, b in (line.split() for line in times.read_text().splitlines())]


def _overlaps(times: list[tuple[str, float, float]], kind: str) -> list[tuple[str, str]]:
    """Pairs of tests that ran at the same time, one of them named ``kind``*."""
    return [
        (a, b)
        for i, (a, a0, a1) in enumerate(times)
        for b, b0, b1 in times[i + 1 :]
        if (a.startswith(kind) or b.startswith(kind)) and a0 < b1 and b0 < a1
    ]


@pytest.mark.parametrize("plugin", [True, False], ids=["tests.alone", "without-it"])
def test_tests_marked_alone_run_while_no_other_test_runs(tmp_path: Path, plugin: bool) -> None:
    """The other tests do run two at a time (so the check can fail); without the plugin (the
    planted bug) the ``alone`` tests share the workers like the rest."""
    times = _timed_run(tmp_path, plugin)
    assert len(times) == 9
    assert _overlaps(times, "shared"), times  # two workers really ran tests at once
    assert bool(_overlaps(times, "alone")) is not plugin, times
