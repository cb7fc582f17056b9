"""Clients of the draft and target workers, with deadlines and failure mapping."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import WorkerUnavailable
from specdec.server import channel_options
from specdec.settings import ServiceSettings
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = structlog.get_logger(__name__)


class WorkerCallFailed(Exception):
    """A worker call failed or timed out (internal: the coordinator decides what the client sees)."""


async def wait_until_serving(channel: grpc.aio.Channel, address: str, timeout_s: float) -> None:
    """Polls grpc.health.v1 until the worker reports SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            last = exc.code().name
        await asyncio.sleep(0.2)
    raise RuntimeError(f"worker {address} not serving after {timeout_s:.0f}s (last status: {last})")


def _channel(address: str, settings: ServiceSettings) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options(settings))


class TargetClient:
    """One target worker replica."""

    def __init__(self, address: str, settings: ServiceSettings) -> None:
        self.address = address
        self._channel = _channel(address, settings)
        self._stub = target_pb2_grpc.TargetWorkerStub(self._channel)
        self.info = common_pb2.WorkerInfo()

    async def connect(self, timeout_s: float) -> common_pb2.WorkerInfo:
        await wait_until_serving(self._channel, self.address, timeout_s)
        self.info = (await self._stub.Info(target_pb2.TargetInfoRequest(), timeout=10.0)).info
        return self.info

    async def fetch_info(self, timeout_s: float) -> common_pb2.WorkerInfo:
        return (await self._call(self._stub.Info(target_pb2.TargetInfoRequest(), timeout=timeout_s))).info

    async def verify(self, request: target_pb2.VerifyRequest, timeout_s: float) -> target_pb2.VerifyResponse:
        return await self._call(self._stub.Verify(request, timeout=timeout_s))

    async def release(self, session_id: str, timeout_s: float) -> bool:
        request = target_pb2.TargetReleaseSessionRequest(session_id=session_id)
        return (await self._call(self._stub.ReleaseSession(request, timeout=timeout_s))).existed

    async def _call(self, call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            log.warning("target_call_failed", address=self.address, code=exc.code().name, details=exc.details())
            raise WorkerUnavailable("the target worker is unavailable; retry later") from exc

    async def close(self) -> None:
        await self._channel.close()


class DraftStream:
    """A session turn's Propose stream: one request in, one proposal out."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call

    async def propose(self, request: draft_pb2.ProposeRequest, timeout_s: float) -> draft_pb2.ProposeResponse:
        try:
            await asyncio.wait_for(self._call.write(request), timeout_s)
            reply = await asyncio.wait_for(self._call.read(), timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as exc:
            self.cancel()
            raise WorkerCallFailed(f"draft propose failed: {exc!r}") from exc
        if reply is grpc.aio.EOF:
            raise WorkerCallFailed("draft closed the stream")
        return reply

    def cancel(self) -> None:
        self._call.cancel()


class DraftClient:
    """The draft worker; after a failure it is skipped for ``retry_s`` (target-only meanwhile)."""

    def __init__(self, address: str, settings: ServiceSettings, retry_s: float) -> None:
        self.address = address
        self._channel = _channel(address, settings)
        self._stub = draft_pb2_grpc.DraftWorkerStub(self._channel)
        self._retry_s = retry_s
        self._down_until = 0.0
        self.info = common_pb2.WorkerInfo()

    async def connect(self, timeout_s: float) -> common_pb2.WorkerInfo:
        await wait_until_serving(self._channel, self.address, timeout_s)
        self.info = (await self._stub.Info(draft_pb2.DraftInfoRequest(), timeout=10.0)).info
        return self.info

    @property
    def usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def mark_failed(self, reason: str) -> None:
        log.warning("draft_unavailable", address=self.address, reason=reason, retry_in_s=self._retry_s)
        self._down_until = time.monotonic() + self._retry_s

    def open_stream(self) -> DraftStream:
        return DraftStream(self._stub.Propose())

    async def release(self, session_id: str, timeout_s: float) -> bool:
        request = draft_pb2.DraftReleaseSessionRequest(session_id=session_id)
        try:
            return (await self._stub.ReleaseSession(request, timeout=timeout_s)).existed
        except grpc.aio.AioRpcError as exc:
            log.warning("draft_release_failed", address=self.address, code=exc.code().name)
            return False

    async def close(self) -> None:
        await self._channel.close()
