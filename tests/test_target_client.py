"""How the coordinator reads a target replica's failed call: the replica's fault (another replica
may serve the request) or this request's."""

from __future__ import annotations

import grpc
import pytest

from coordinator.settings import CoordinatorSettings
from coordinator.workers import TargetClient
from specdec.serving.errors import WorkerFailed, WorkerUnavailable
from specdec.v1 import target_pb2


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
