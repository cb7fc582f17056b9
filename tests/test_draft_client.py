"""How long the coordinator waits for a draft proposal."""

from __future__ import annotations

import pytest

from coordinator.settings import CoordinatorSettings
from coordinator.workers import DraftClient


@pytest.mark.asyncio
async def test_patience_stretches_for_a_busy_draft_but_not_below_the_timeout() -> None:
    settings = CoordinatorSettings(target_addresses=["127.0.0.1:1"])
    draft = DraftClient("127.0.0.1:1", settings, retry_s=1.0, timeout_s=2.0)
    try:
        assert draft.patience_s == 2.0  # nothing measured yet
        draft.observe_latency(0.1)
        assert draft.patience_s == 2.0  # a fast draft: the configured timeout
        for _ in range(30):
            draft.observe_latency(1.5)  # proposals queue behind other sessions' passes
        assert draft.patience_s == pytest.approx(4.5, rel=0.01)
    finally:
        await draft.close()


@pytest.mark.asyncio
async def test_a_late_draft_whose_info_fails_is_retried_at_a_pace() -> None:
    """A draft address that answers health checks SERVING but whose Info call fails (another kind
    of service there, or a draft failing its Info) once start-up has gone on without it: the join
    tries again every --draft-retry-s, not in a loop as fast as the calls fail (hundreds of
    `draft_not_ready` warnings a second before)."""
    import asyncio

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from prometheus_client import CollectorRegistry
    from structlog.testing import capture_logs

    from coordinator.engine import Engine
    from specdec.serving.metrics import CoordinatorMetrics
    from specdec.v1 import common_pb2

    server = grpc.aio.server()  # health SERVING, no DraftWorker service: Info is UNIMPLEMENTED
    checks = health.aio.HealthServicer()
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    settings = CoordinatorSettings(
        target_addresses=["127.0.0.1:1"], draft_address=f"127.0.0.1:{port}", draft_retry_s=1.0
    )
    engine = Engine(settings, CoordinatorMetrics(CollectorRegistry()))
    assert engine.draft is not None
    try:
        with capture_logs() as logs:
            connecting = asyncio.ensure_future(engine.draft.connect(60))
            join = asyncio.ensure_future(engine._join_draft(connecting, common_pb2.WorkerInfo(), 60))
            await asyncio.sleep(2.5)
            join.cancel()
        failures = [e for e in logs if e["event"] == "draft_not_ready"]
        assert 2 <= len(failures) <= 4, len(failures)
        assert "UNIMPLEMENTED" in failures[0]["error"]
    finally:
        await engine.stop()
        await server.stop(None)
