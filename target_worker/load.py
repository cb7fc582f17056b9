"""How many requests of the coordinators that use this target worker are generating on it.

Each verify call carries its coordinator's id and how many of its requests are generating on this
worker at that moment (``VerifyRequest.coordinator_id`` / ``coordinator_requests``); the worker
keeps each coordinator's latest count and answers every call with their sum
(``VerifyResponse.service_requests``), which ``--speculation-max-requests`` compares against: with
several coordinators in front of one target (the k8s manifests run two) each would otherwise see
only its own requests.

A coordinator with requests generating calls every round; one that has gone quiet stops counting
once it has been silent for twice the longest gap between its calls lately (MIN_SILENCE_S at
least; a gap counts for at most MAX_GAP_S and is forgotten with a half-life of GAP_HALF_LIFE_S,
so the idle time before a burst does not stretch it), so a burst that ended holds another
coordinator's requests to target-only decoding for seconds at most. Counts are read at verify
time, when the coordinators with requests generating are calling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec.serving.errors import InvalidRequest

MIN_SILENCE_S = 1.0
MAX_GAP_S = 5.0
GAP_HALF_LIFE_S = 2.0
MAX_COORDINATORS = 256  # counts kept at most (the most recently heard from)
MAX_ID_CHARS = 128
UINT32_MAX = 2**32 - 1  # the largest sum a reply carries (VerifyResponse.service_requests)


@dataclass
class _Report:
    requests: int
    at: float  # when it was heard from last
    gap: float  # the longest gap between its calls lately, decayed


class ServiceLoad:
    """The coordinators' latest counts; see the module doc."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._reports: dict[str, _Report] = {}  # in the order they were last heard from

    def report(self, coordinator: str, requests: int) -> int:
        """Records ``coordinator``'s count (an empty id is not counted: a coordinator older than
        the field) and returns the sum over the coordinators still counted, at most UINT32_MAX
        (more does not fit the reply; any count that large is past every limit it is compared with)."""
        if len(coordinator) > MAX_ID_CHARS:
            raise InvalidRequest(f"coordinator_id has {len(coordinator)} characters; at most {MAX_ID_CHARS}")
        now = self._clock()
        if coordinator:
            last = self._reports.pop(coordinator, None)
            gap = 0.0
            if last is not None:
                since = now - last.at
                gap = min(max(since, last.gap * 0.5 ** (since / GAP_HALF_LIFE_S)), MAX_GAP_S)
            self._reports[coordinator] = _Report(requests, now, gap)
            while len(self._reports) > MAX_COORDINATORS:
                del self._reports[next(iter(self._reports))]
        quiet = [name for name, r in self._reports.items() if now - r.at > max(MIN_SILENCE_S, 2 * r.gap)]
        for name in quiet:
            del self._reports[name]
        return min(sum(r.requests for r in self._reports.values()), UINT32_MAX)
