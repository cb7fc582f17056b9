"""The test helpers' own checks: work split over two processes, tests that run alone, test
files queued longest first, the comparison of two replies' logprobs, free ports, the greedy
reference's float near ties, the chi-square checks' thresholds."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import reference, spec_oracle
from tests.helpers import free_ports, in_two_processes, script_module
from tests.test_combinations import MIXES
from tests.tiny_models import TinyModels

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

_WORK = """
import os, time
import pytest

def _work(name):
    began = time.monotonic()
    time.sleep(0.8)
    with open(os.environ["TIMES_FILE"], "a") as out:
        out.write(f"{name} {began} {time.monotonic()}\\n")
"""


def _sleeping(name: str, count: int) -> str:
    """A file's ``count`` tests named ``name`` that each sleep in _WORK."""
    return f"""
@pytest.mark.parametrize("i", range({count}))
def test_{name}(i):
    _work(f"{name}{{i}}")
"""


_SHARED = _sleeping("shared", 6)
_ALONE = """
@pytest.mark.alone
@pytest.mark.parametrize("i", range(3))
def test_alone(i):
    _work(f"alone{i}")
"""


def _timed_run(
    tmp_path: Path,
    plugin: bool,
    files: dict[str, str] | None = None,
    dist: str = "load",
    seconds: dict[str, float] | None = None,
    argv: tuple[str, ...] = (),
) -> list[tuple[str, float, float]]:
    """Runs sleeping tests on two xdist workers (by default 9 in one file, 3 of them marked
    ``alone``; or ``files``, each file's tests after _WORK); their times. With ``seconds``, the
    files' seconds table of tests/schedule.py (its plugin loaded); ``argv``: more options."""
    ini = "[pytest]\nmarkers = alone: see tests/alone.py\n"
    plugins = ["tests.alone"] if plugin else []
    if seconds is not None:
        (tmp_path / "seconds.json").write_text(json.dumps(seconds))
        ini += "file_seconds = seconds.json\n"
        plugins.append("tests.schedule")
    (tmp_path / "pytest.ini").write_text(ini)
    (tmp_path / "conftest.py").write_text(f"pytest_plugins = {plugins!r}\n")
    for name, tests in (files or {"test_timed.py": _SHARED + _ALONE}).items():
        (tmp_path / name).write_text(_WORK + tests)
    times = tmp_path / "times.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIMES_FILE": str(times)}
    argv = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", dist, *argv)
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


def test_alone_tests_in_a_row_run_back_to_back(tmp_path: Path) -> None:
    """A file of ``alone`` tests on one worker (``--dist loadfile``, as the suite runs) keeps the
    room from the first to the last: no test of the other worker's file runs between them (one ran
    in a gap while each handed the room back: on main, 2 and 1 of the 6 in two runs)."""
    times = _timed_run(tmp_path, True, {"test_a.py": _SHARED, "test_b.py": _ALONE}, dist="loadfile")
    alone = [(began, ended) for name, began, ended in times if name.startswith("alone")]
    first, last = min(began for began, _ in alone), max(ended for _, ended in alone)
    assert len(alone) == 3 and len(times) == 9
    assert not [name for name, began, ended in times if name.startswith("shared") and began < last and ended > first]


@pytest.mark.parametrize(
    ("reorder", "table"),
    [("--no-loadscope-reorder", True), ("--loadscope-reorder", True), ("--no-loadscope-reorder", False)],
    ids=["as-the-suite-runs", "xdist-reorders", "without-the-table"],
)
def test_the_longest_file_is_queued_first(tmp_path: Path, reorder: str, table: bool) -> None:
    """With the suite's options (``--dist loadfile --no-loadscope-reorder``) and tests/schedule.py's
    table, a file of one test listed as the longest starts at once on two workers beside files of 4
    and 3 tests that come before it by name; where xdist orders the files (by their number of
    tests) or no table does (by name), the planted bugs, it starts last, more than a test's 0.8 s
    after the first."""
    files = {
        "test_a_many.py": _sleeping("many", 4),
        "test_b_mid.py": _sleeping("mid", 3),
        "test_c_few.py": _sleeping("few", 1),
    }
    seconds = {"test_c_few.py": 300.0, "test_a_many.py": 20.0, "test_b_mid.py": 10.0} if table else None
    times = _timed_run(tmp_path, True, files, dist="loadfile", seconds=seconds, argv=(reorder,))
    first = min(began for _, began, _ in times)
    (few,) = [began for name, began, _ in times if name.startswith("few")]
    assert len(times) == 8
    assert (few - first < 0.4) is (reorder == "--no-loadscope-reorder" and table), times


def test_the_file_seconds_table_lists_every_test_file() -> None:
    """tests/file_seconds.json (pyproject's ``file_seconds``) lists each test file, so a new one is
    given its place in the queue (scripts/file_seconds.py writes the table from a run's
    ``--durations=0``, or add the new file's seconds by hand) and a removed one leaves it; and
    the script reads that output."""
    table = json.loads((ROOT / "tests" / "file_seconds.json").read_text())
    files = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").glob("test_*.py")}
    assert set(table) == files, "update tests/file_seconds.json: python scripts/file_seconds.py --help"
    log = "12.50s call     tests/test_a.py::test_x[1]\n0.50s setup    tests/test_a.py::test_y\n"
    log += "(3 durations < 0.005s hidden.)\n1.00s call tests/test_b.py::t\n"
    assert script_module("file_seconds").file_seconds(log) == {"tests/test_a.py": 13.0, "tests/test_b.py": 1.0}


def test_top_logprobs_tied_at_the_cut_agree_in_either_order() -> None:
    """Two replies' top-5 alternatives from passes of other shapes (a session's turn and its
    target-only replay, from a random run): the 4th and 5th choices 2.0e-4 apart, the logprobs
    within 3e-6. The comparison found the 4th clear of the cut in one reply and not in the
    other, and failed them. A token is compared by position only where it is clear in both."""
    from tests.test_combinations import _tops_agree

    ours = ((221, -2.5199532508850098), (170, -2.8230385780334473), (164, -3.23317289352417),
            (124, -3.5545032024383545), (150, -3.5547025203704834))  # fmt: skip
    theirs = ((221, -2.5199522972106934), (170, -2.8230361938476562), (164, -3.233170747756958),
              (124, -3.554502010345459), (150, -3.5547022819519043))  # fmt: skip
    assert _tops_agree(ours, theirs) and _tops_agree(theirs, ours)
    values = [value for _, value in theirs]
    for tokens in ([221, 164, 170, 124, 150], [221, 170, 99, 124, 150]):  # clear choices swapped, or another one
        assert not _tops_agree(ours, tuple(zip(tokens, values, strict=True)))


def test_ports_asked_for_together_are_distinct() -> None:
    """A process that listens on two ports (the gateway and its metrics) asks for them together:
    one free port asked for twice, each socket closed before the next, is sometimes the same port
    (the kernel picks a free one at random; a CI run's gateway died of it, "--prometheus-port and
    --port are both 55133"). 2,000 at once: drawn one by one, two of them match almost surely."""
    ports = free_ports(2000)
    assert len(set(ports)) == len(ports)


def test_the_greedy_reference_takes_a_service_s_token_only_at_a_float_near_tie(
    tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``greedy_continuation`` with ``prefer``: the service's token where its logit is within
    NEAR_TIE of the best (then goes on after it), the argmax anywhere else; ``logit_gap`` gives
    how far a token's logit lies below the best."""
    target, history = str(tiny_models.target), [5, 17, 3, 99]
    model = reference._greedy_model(target)
    with torch.inference_mode():
        logits = model(torch.tensor([history])).logits[0, -1]
    (best, runner_up), worst = logits.topk(2).indices.tolist(), int(logits.argmin())
    gap = float(logits[best] - logits[runner_up])
    plain = reference.greedy_continuation(target, history, 3)
    assert plain[0] == best and gap > reference.NEAR_TIE  # a gap the default does not take
    assert reference.logit_gap(target, history, best) == 0
    assert reference.logit_gap(target, history, runner_up) == pytest.approx(gap, rel=1e-5)
    assert reference.greedy_continuation(target, history, 3, [runner_up, *plain[1:]]) == plain
    assert reference.greedy_continuation(target, history, 3, [worst]) == plain
    monkeypatch.setattr(reference, "NEAR_TIE", gap * 1.01)  # as if the two were a near tie
    taken = reference.greedy_continuation(target, history, 3, [runner_up])
    assert taken == [runner_up, *reference.greedy_continuation(target, [*history, runner_up], 2)]
    assert reference.greedy_continuation(target, history, 3, [worst]) == plain
    monkeypatch.setattr(reference, "NEAR_TIE", gap * 0.99)
    assert reference.greedy_continuation(target, history, 3, [runner_up]) == plain


def test_every_chi_square_check_compares_with_the_suite_s_thresholds() -> None:
    """The suite's false-alarm chance per run is about the number of chi-square checks times
    spec_oracle.PASS_P; a check comparing its p-value with a number of its own would escape that
    budget (at 1e-3 each, about one run in 20 failed with a correct service)."""
    literal = re.compile(r"pvalue\b.*[<>]=?\s*[0-9]")
    found = [
        f"{path.name}:{number}"
        for path in sorted(Path(__file__).parent.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not found, f"compare the p-value with spec_oracle.PASS_P or PLANTED_P: {found}"


def test_the_tail_script_computes_the_suite_s_p_values_and_reports_each_mix(capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/chi_square_tail.py (how often the chi-square check fails a correct service): its
    vectorized p-values equal spec_oracle.chi_square_pvalue's, pooled outcomes included, and it
    prints a line per sampled mix of tests/test_combinations.py with a share per threshold."""
    script = script_module("chi_square_tail")
    probs = np.array([0.5, 0.3, 0.15, 0.03, 0.015, 0.005])  # at n = 200 the last three are pooled
    draws = np.random.default_rng(0).multinomial(200, probs, size=20)
    exact = {(i,): float(p) for i, p in enumerate(probs)}
    want = [
        spec_oracle.chi_square_pvalue(collections.Counter({(i,): int(c) for i, c in enumerate(row) if c}), exact, 200)
        for row in draws
    ]
    assert script.pooled_pvalues(draws, probs) == pytest.approx(want, rel=1e-9)
    assert script.main(["--reps", "1000"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "samples of 1500" in line]
    assert [line.split()[0] for line in lines] == list(MIXES)
    assert all(line.count("x)") == 4 for line in lines)
