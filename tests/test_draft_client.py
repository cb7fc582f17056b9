"""How long the coordinator waits for a draft proposal."""

from __future__ import annotations

import pytest

from coordinator.settings import CoordinatorSettings
from coordinator.workers import DraftClient, DraftPool, place
from specdec.v1 import common_pb2


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
    assert engine.drafts is not None
    (draft,) = engine.drafts.replicas
    try:
        with capture_logs() as logs:
            connecting = asyncio.ensure_future(draft.connect(60))
            join = asyncio.ensure_future(engine._join_draft(draft, connecting, common_pb2.WorkerInfo(), 60))
            await asyncio.sleep(2.5)
            join.cancel()
        failures = [e for e in logs if e["event"] == "draft_not_ready"]
        assert 2 <= len(failures) <= 4, len(failures)
        assert "UNIMPLEMENTED" in failures[0]["error"]
    finally:
        await engine.stop()
        await server.stop(None)


@pytest.mark.asyncio
async def test_sessions_are_placed_by_cache_unless_that_replica_is_clearly_busier() -> None:
    """Where a session with nothing of its own cached starts: with nothing cached and no load,
    spread by rendezvous hash; on the replica holding the longest cached prefix of its prompt
    while that one runs at most 2 turns more than the least busy (or at most 1.25x as many);
    else on the least busy one. Replicas not joined yet, or down, are never chosen."""
    addresses = ["d0:1", "d1:1", "d2:1"]
    settings = CoordinatorSettings(target_addresses=["t:1"], draft_addresses=addresses)
    pool = DraftPool(addresses, settings, retry_s=60.0, timeout_s=2.0)
    try:
        sessions = [f"s{i}" for i in range(300)]
        assert not pool.usable and place(pool.replicas, "s0", {}) is None  # none has joined yet
        for replica in pool.replicas:
            pool.join(replica, common_pb2.WorkerInfo(vocab_size=9, tokenizer_hash="h"))
        assert pool.usable and all(r.vocab_limit == 9 and r.tokenizer_hash == "h" for r in pool.replicas)
        home = {s: place(pool.replicas, s, {}) for s in sessions}
        counts = [sum(r is replica for r in home.values()) for replica in pool.replicas]
        assert min(counts) > 60, counts  # about 100 each
        d0, d1, d2 = pool.replicas
        assert all(place(pool.replicas, s, {"d1:1": 32, "d2:1": 16}) is d1 for s in sessions)
        d1.turns, d0.turns, d2.turns = 2, 0, 5
        assert place(pool.replicas, "s0", {"d1:1": 32}) is d1  # 2 more than the least busy: not clearly busier
        d1.turns = 3
        assert place(pool.replicas, "s0", {"d1:1": 32}) is d0  # 3 more, and more than 1.25x
        d0.turns, d1.turns, d2.turns = 12, 15, 20
        assert place(pool.replicas, "s0", {"d1:1": 32}) is d1  # 3 more, but only 1.25x as many
        assert place(pool.replicas, "s0", {}) is d0  # nothing cached: the least busy
        d2.mark_failed("test")
        assert place(pool.replicas, "s0", {"d2:1": 64}) is d0
        d0.mark_failed("test")
        d1.mark_failed("test")
        assert not pool.usable and place(pool.replicas, "s0", {}) is None
    finally:
        await pool.close()


@pytest.mark.asyncio
async def test_a_draft_replica_of_another_model_than_the_first_is_reported() -> None:
    """Draft replicas of one vocabulary but different models are all used (the target verifies
    whatever is proposed), but GetInfo reports the first one's limits: `draft_replicas_differ`
    names the fields that differ, as `target_replicas_differ` does for targets."""
    from prometheus_client import CollectorRegistry
    from structlog.testing import capture_logs

    from coordinator.engine import Engine
    from specdec.serving.metrics import CoordinatorMetrics

    addresses = ["d0:1", "d1:1", "d2:1"]
    settings = CoordinatorSettings(target_addresses=["t:1"], draft_addresses=addresses)
    engine = Engine(settings, CoordinatorMetrics(CollectorRegistry()))
    assert engine.drafts is not None
    target = common_pb2.WorkerInfo(model_id="t", vocab_size=9, tokenizer_hash="h")
    first, same, other = engine.drafts.replicas
    try:
        with capture_logs() as logs:
            for replica, model, context in ((first, "a", 64), (same, "a", 64), (other, "b", 32)):
                info = common_pb2.WorkerInfo(model_id=model, tokenizer_hash="h", max_context_len=context)
                engine._fit_draft(replica, target, info)
        (warning,) = [e for e in logs if e["event"] == "draft_replicas_differ"]
        assert warning["address"] == "d2:1" and warning["fields"] == ["model_id", "max_context_len"]
        assert warning["first"] == {"model_id": "a", "max_context_len": 64}
        assert all(r.usable for r in engine.drafts.replicas)
    finally:
        await engine.stop()
