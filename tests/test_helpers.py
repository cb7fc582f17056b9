"""The test helpers' own checks: work split over two processes."""

from __future__ import annotations

import os

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
