"""target_worker.load.ServiceLoad: the sum of the latest request counts of the coordinators that
use a target worker, a coordinator forgotten once it has gone quiet."""

from __future__ import annotations

import pytest

from specdec.serving.errors import InvalidRequest
from target_worker.load import MAX_COORDINATORS, MAX_GAP_S, MAX_ID_CHARS, MIN_SILENCE_S, UINT32_MAX, ServiceLoad


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_latest_count_of_each_coordinator_is_summed() -> None:
    clock = Clock()
    load = ServiceLoad(clock)
    assert load.report("a", 3) == 3
    assert load.report("b", 5) == 8
    clock.now += 0.1
    assert load.report("a", 1) == 6  # a's latest count replaces its earlier one
    assert load.report("", 7) == 6  # a coordinator without an id (older than the field) is not counted


def test_a_coordinator_that_went_quiet_stops_counting() -> None:
    """Forgotten after twice the longest gap between its calls lately (MIN_SILENCE_S at least):
    a coordinator whose rounds came 2 s apart counts for 4 s after its last call."""
    clock = Clock()
    load = ServiceLoad(clock)
    load.report("quick", 4)
    clock.now += MIN_SILENCE_S / 2
    assert load.report("other", 1) == 5
    clock.now += MIN_SILENCE_S
    assert load.report("other", 1) == 1  # quick: silent for 1.5 s, its gaps none
    for _ in range(3):
        load.report("slow", 2)
        clock.now += 2.0
    assert load.report("other", 1) == 3  # slow: silent for 2 s, its gaps 2 s
    clock.now += 1.9
    assert load.report("other", 1) == 3
    clock.now += 0.2
    assert load.report("other", 1) == 1  # 4.1 s
    load.report("idle", 1)
    clock.now += 60.0  # a gap between bursts counts for MAX_GAP_S at most, and fades during the burst
    load.report("idle", 2)
    assert load.report("other", 1) == 3
    clock.now += 2 * MAX_GAP_S + 0.1
    assert load.report("other", 1) == 1


def test_the_coordinators_kept_are_bounded() -> None:
    clock = Clock()
    load = ServiceLoad(clock)
    for i in range(MAX_COORDINATORS + 10):
        load.report(f"c{i}", 1)
    assert load.report("last", 1) == MAX_COORDINATORS  # the ones heard from longest ago went first
    with pytest.raises(InvalidRequest, match="coordinator_id"):
        load.report("x" * (MAX_ID_CHARS + 1), 1)


def test_the_sum_stops_at_the_largest_count_a_reply_carries() -> None:
    """The sum goes into VerifyResponse.service_requests (uint32): two coordinators' counts past
    it made every verify reply of the worker fail to serialize ("Value out of range:
    4294967300", INTERNAL, until the report went quiet); the sum now stops at UINT32_MAX."""
    load = ServiceLoad(Clock())
    assert load.report("a", UINT32_MAX) == UINT32_MAX
    assert load.report("b", 5) == UINT32_MAX
