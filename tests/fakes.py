"""Fakes for unit tests of the coordinator's WorkerSession: target replicas and their pool."""

from __future__ import annotations

from specdec.v1 import common_pb2, target_pb2


class FakeTarget:
    """A target replica that answers every verify at once, or (``fails``) is unavailable.
    ``applies``: its verdicts say that the grammar masked them (a worker older than grammars
    leaves the field unset). Each verdict's ``service_requests`` is the count the verify told it,
    as a lone coordinator's report gives back; ``sent``: those counts, ``calls``: the verifies.
    ``resyncs``: its first answers are RESYNC_REQUIRED, each with this ``resync_from``; ``syncs``:
    the base_len, source session and shared_len of each verify."""

    role = "target"

    def __init__(self, address: str, applies: bool = True, fails: bool = False, resyncs: tuple[int, ...] = ()) -> None:
        from coordinator.workers import PrefillQueue, _Breaker

        self.address, self.applies, self.fails, self.resyncs = address, applies, fails, list(resyncs)
        self.calls, self.sent, self.syncs = 0, list[int](), list[tuple[int, str, int]]()
        self.grammars = True  # what the coordinator believes (its Info said so before a restart)
        self.breaker, self.prefills, self.turns = _Breaker(1.0), PrefillQueue(), 0
        self.info = common_pb2.WorkerInfo(max_draft_tokens=64)

    async def verify(self, request: target_pb2.VerifyRequest, timeout_s: float) -> target_pb2.VerifyResponse:
        from coordinator.workers import WorkerUnavailable

        self.calls += 1
        if self.fails:
            raise WorkerUnavailable("the target worker is unavailable; retry later")
        self.sent.append(request.coordinator_requests)
        self.syncs.append((request.sync.base_len, request.sync.source_session_id, request.sync.shared_len))
        if self.resyncs:
            return target_pb2.VerifyResponse(
                cache_status=common_pb2.CACHE_STATUS_RESYNC_REQUIRED, resync_from=self.resyncs.pop(0)
            )
        return target_pb2.VerifyResponse(
            cache_status=common_pb2.CACHE_STATUS_OK, token_ids=[7], cache_len=len(request.sync.tail_token_ids) + 1,
            constrained=self.applies and bool(request.processing.grammar),
            service_requests=request.coordinator_requests,
        )  # fmt: skip

    @property
    def requests(self) -> int:
        """As ``TargetClient.requests``, with no other coordinator: this coordinator's turns."""
        return self.turns


class FakeTargets:
    """A TargetPool of FakeTargets: the session's replica first, then the others in order."""

    def __init__(self, *replicas: FakeTarget) -> None:
        self.replicas = list(replicas)

    def candidates(self, session_id: str, current: str | None) -> list[FakeTarget]:
        return sorted(self.replicas, key=lambda r: r.address != current)

    def get(self, address: str) -> FakeTarget | None:
        return next((r for r in self.replicas if r.address == address), None)
