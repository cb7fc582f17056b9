"""How the coordinator reads a target replica's failed call: the replica's fault (another replica
may serve the request) or this request's; and what its replies say of the other coordinators'
requests."""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from coordinator.settings import CoordinatorSettings
from coordinator.workers import TargetClient, TargetPool
from specdec.serving.errors import WorkerFailed, WorkerUnavailable
from specdec.v1 import common_pb2, target_pb2


async def _verify_answering(code: grpc.StatusCode) -> None:
    """Verifies once against a real gRPC server whose Verify ends every call with ``code`` (as a
    replica's gRPC stack does when it stops with the call in flight: CANCELLED behind a proxy)."""

    async def verify(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(code, "Cancelling all calls")

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(verify)
    service = grpc.method_handlers_generic_handler("specdec.v1.TargetWorker", {"Verify": handler})
    server.add_generic_rpc_handlers((service,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = TargetClient(f"127.0.0.1:{port}", CoordinatorSettings(target_addresses=["127.0.0.1:1"]), retry_s=1.0)
    try:
        await client.verify(target_pb2.VerifyRequest(session_id="s"), timeout_s=5.0)
    finally:
        await client.close()
        await server.stop(None)


@pytest.mark.asyncio
@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE])
async def test_a_call_the_replica_ended_is_the_replica_s_fault(code: grpc.StatusCode) -> None:
    """A call the replica cancelled (it was stopping) fails over like an unreachable replica; it is
    not an error of the request (INTERNAL to the client)."""
    with pytest.raises(WorkerUnavailable):
        await _verify_answering(code)


@pytest.mark.asyncio
async def test_an_error_of_the_request_is_not_failed_over() -> None:
    with pytest.raises(WorkerFailed):
        await _verify_answering(grpc.StatusCode.INVALID_ARGUMENT)


async def _serving_target(info: common_pb2.WorkerInfo, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """A real gRPC server that reports SERVING and answers Info with ``info``; its port."""

    async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return target_pb2.TargetInfoResponse(info=info).SerializeToString()

    server = grpc.aio.server()
    checks = health.aio.HealthServicer()
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    handlers = {"Info": grpc.unary_unary_rpc_method_handler(answer)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specdec.v1.TargetWorker", handlers),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


@pytest.mark.asyncio
async def test_a_replica_that_has_not_served_is_tried_last_until_it_joins() -> None:
    """Two replicas, one serving (a real health and Info server) and one unreachable: start-up
    returns with the first, and the other stays behind it in every session's order, also after a
    failed call tripped it (a trip does not cut its wait short); one that did not serve within the
    start-up timeout is then retried like a replica that failed."""

    server, port = await _serving_target(common_pb2.WorkerInfo(model_id="m", vocab_size=9))
    addresses = ["127.0.0.1:1", f"127.0.0.1:{port}"]
    pool = TargetPool(addresses, CoordinatorSettings(target_addresses=addresses), retry_s=0.01)
    try:
        assert (await asyncio.wait_for(pool.connect(60), 10)).model_id == "m"
        down, up = pool.replicas
        assert up.breaker.up and not down.breaker.up
        down.breaker.trip()
        await asyncio.sleep(0.05)  # past retry_s
        assert not down.breaker.up
        assert [r.address for r in pool.candidates("s", current=None)] == [up.address, down.address]
    finally:
        await pool.close()
    pool = TargetPool(addresses, CoordinatorSettings(target_addresses=addresses), retry_s=0.01)
    try:  # a replica that never served within the start-up timeout is retried like one that failed
        await pool.connect(0.5)
        await asyncio.sleep(1.0)
        assert all(r.breaker.up for r in pool.replicas)
    finally:
        await pool.close()
        await server.stop(None)


@pytest.mark.asyncio
@pytest.mark.parametrize("late", [False, True], ids=["at-start", "joining-later"])
async def test_replicas_serving_different_models_of_one_vocabulary_are_reported(late: bool) -> None:
    """Qwen2.5-Coder 0.5B and 1.5B share a tokenizer and a vocabulary size, so a verify naming the
    vocabulary does not tell them apart, and a session's greedy tokens would depend on the replica
    it lands on (a rollout gone wrong, or under way). Every replica that joins is compared with the
    first: a `target_replicas_differ` warning names the fields that differ."""
    first, first_port = await _serving_target(common_pb2.WorkerInfo(model_id="qwen-0.5b", vocab_size=9))
    other, other_port = await _serving_target(
        common_pb2.WorkerInfo(model_id="qwen-1.5b", vocab_size=9, max_context_len=64)
    )
    addresses = [f"127.0.0.1:{first_port}", f"127.0.0.1:{other_port}"]
    pool = TargetPool(addresses, CoordinatorSettings(target_addresses=addresses), retry_s=0.01)
    try:
        with capture_logs() as logs:
            if late:
                await other.stop(None)
                await pool.connect(30)
                other, _ = await _serving_target(
                    common_pb2.WorkerInfo(model_id="qwen-1.5b", vocab_size=9, max_context_len=64), other_port
                )
                await _until(lambda: pool.replicas[1].breaker.up)
            else:
                await pool.connect(30)
                await asyncio.sleep(0.5)  # the second replica answers too
        warnings = [e for e in logs if e["event"] == "target_replicas_differ"]
        assert len(warnings) == 1, logs
        assert warnings[0]["fields"] == ["model_id", "max_context_len"]
    finally:
        await pool.close()
        await first.stop(None)
        await other.stop(None)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(400):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("condition not met within 20 s")


def test_a_start_up_wait_says_what_it_waits_for_at_once_then_every_10_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first line comes with the first failed check (info: workers still loading are the usual
    case), then a warning every 10 s with the seconds waited and left."""
    import coordinator.workers as workers

    now = [100.0]
    monkeypatch.setattr(workers.time, "monotonic", lambda: now[0])
    wait = workers.StartupWait("waiting_for_worker", 30.0, role="target")
    with capture_logs() as logs:
        for _ in range(25):  # a check every 0.5 s: 12.5 s
            wait.tick(status="UNAVAILABLE")
            now[0] += 0.5
    assert [(line["log_level"], line["waited_s"], line["gives_up_in_s"]) for line in logs] == [
        ("info", 0.0, 30.0), ("warning", 10.0, 20.0),
    ]  # fmt: skip
    assert all(line["role"] == "target" and line["status"] == "UNAVAILABLE" for line in logs)


@pytest.mark.parametrize(
    ("answers", "bases"),
    [
        ((32,), [(40, "donor", 0), (32, "donor", 40)]),  # started from the copy at the donor's prompt end
        ((32, 0), [(40, "donor", 0), (32, "donor", 40), (0, "", 40)]),  # that copy freed before the second call
        ((32, 24), [(40, "donor", 0), (32, "donor", 40), (0, "", 40)]),  # the last try is always from 0
        ((40,), [(40, "donor", 0), (0, "", 40)]),  # an answer no shorter than what was sent: from 0
        ((0,), [(40, "donor", 0), (0, "", 40)]),  # a worker older than the field
        ((), [(40, "donor", 0)]),  # the found prefix served as it is: no copy asked for
    ],
)
async def test_a_resync_resends_from_where_the_worker_can_start(
    answers: tuple[int, ...], bases: list[tuple[int, str, int]]
) -> None:
    """A worker that cannot start from the sent prefix but can from a shorter one (a windowed
    model's copy at a prompt's end) says so (``resync_from``): the coordinator resends from there,
    with the same source session, and from 0 if that fails too (whatever it answers then: the
    third call always succeeds) or the answer is not shorter. The
    calls after a resync say where the prefix found for other sessions ends (``shared_len``: the
    worker keeps a copy of its windowed layers there for the next request that shares it)."""
    from prometheus_client import CollectorRegistry

    from coordinator.worker_session import Decoding, WorkerSession
    from specdec.runtime.sampling import Warp
    from specdec.serving.metrics import CoordinatorMetrics
    from specdec.state.base import CacheLocation, PrefixLocation
    from tests.fakes import FakeTarget, FakeTargets

    replica = FakeTarget("t:1", resyncs=answers)
    session = WorkerSession("s", FakeTargets(replica), None, CoordinatorMetrics(CollectorRegistry()), 5.0, None)  # type: ignore[arg-type]
    session.place([(PrefixLocation("donor", CacheLocation("t:1", 40), None), 40)])
    session.shared_len = 40
    committed = list(range(3, 53))
    reply, reused = await session.verify(committed, common_pb2.DraftBlock(), Decoding(Warp(), 0))
    assert reply.cache_status == common_pb2.CACHE_STATUS_OK and replica.syncs == bases
    assert reused == bases[-1][0] and session.counters.resyncs == len(bases) - 1


@pytest.mark.asyncio
async def test_the_other_coordinators_requests_are_counted_while_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica's verify reply counts the requests of every coordinator that uses it
    (``service_requests``); less the ones this call told it (``coordinator_requests``), they are the
    other coordinators', which every turn of this coordinator on that replica counts (a new turn's
    first round too), on top of its own turns, for OTHERS_FRESH_S after the reply; then they are
    not taken as they were (the replica's latest word is too old)."""
    from coordinator import workers

    async def verify(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return target_pb2.VerifyResponse(
            cache_status=common_pb2.CACHE_STATUS_OK, service_requests=5
        ).SerializeToString()

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(verify)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("specdec.v1.TargetWorker", {"Verify": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = TargetClient(f"127.0.0.1:{port}", CoordinatorSettings(target_addresses=["127.0.0.1:1"]), retry_s=1.0)
    try:
        client.turns = 2
        assert client.requests == 2  # nothing heard yet
        await client.verify(target_pb2.VerifyRequest(coordinator_id="c", coordinator_requests=2), timeout_s=5.0)
        client.turns = 3  # a new turn here
        assert client.requests == 3 + 3
        later = time.monotonic() + workers.OTHERS_FRESH_S + 0.1
        monkeypatch.setattr(workers, "time", types.SimpleNamespace(monotonic=lambda: later))
        assert client.requests == 3
    finally:
        monkeypatch.undo()
        await client.close()
        await server.stop(None)
