"""gRPC server plumbing shared by every service: errors, health, reflection, lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.errors import SpecdecError
from specdec.settings import ServiceSettings

log = structlog.get_logger(__name__)
T = TypeVar("T")

INTERNAL_MESSAGE = "internal error; the server logged the details"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, SpecdecError):
        log.info("rpc_failed", code=exc.code.name, error=str(exc))
        await context.abort(exc.code, str(exc))
    log.exception("rpc_crashed")
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def _wrap_unary(fn: Callable[[Any, Any], Awaitable[Any]], method: str) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with structlog.contextvars.bound_contextvars(rpc=method):
            try:
                return await fn(request, context)
            except Exception as exc:
                await _abort(context, exc)

    return handler


def _wrap_stream(fn: Callable[[Any, Any], AsyncIterator[Any]], method: str) -> Callable[[Any, Any], AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with structlog.contextvars.bound_contextvars(rpc=method):
            try:
                async for item in fn(request, context):
                    yield item
            except Exception as exc:
                await _abort(context, exc)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps SpecdecError to its status code and anything else to a generic INTERNAL.

    Applies to specdec's own services; binds the RPC name into the log context.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith("/specdec."):
            return handler
        name = method.rsplit("/", 1)[-1]
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, name), **codec)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, name), **codec)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, name), **codec)
        return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, name), **codec)


class ModelThread:
    """The single thread a worker runs its model in (model compute never blocks the event loop)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def channel_options(settings: ServiceSettings) -> list[tuple[str, Any]]:
    """Message size limits and keepalive used by both servers and clients."""
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


@dataclass
class ServiceSpec:
    """What a service adds to the shared server."""

    service_names: Sequence[str]
    register: Callable[[grpc.aio.Server], None]
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]


class Health:
    """The grpc.health.v1 servicer with all of a process's service names flipped together."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self._names = ["", *service_names]

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            await self.servicer.set(name, status)


def _write_ready_file(path: str, port: int) -> None:
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    tmp.replace(target)


async def serve(settings: ServiceSettings, spec: ServiceSpec) -> None:
    """Runs a service until SIGTERM/SIGINT, then drains within the grace period.

    Health is NOT_SERVING until ``spec.start`` (e.g. model loading) has finished, and again
    as soon as shutdown begins; new RPCs are refused while in-flight ones finish.
    """
    server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=channel_options(settings))
    health_state = Health(spec.service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    spec.register(server)
    reflection.enable_server_reflection([*spec.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {settings.host}:{settings.port}; is the port in use?")
    await health_state.set(False)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("server_started", port=port, services=list(spec.service_names))
    try:
        await spec.start()
        await health_state.set(True)
        if settings.ready_file:
            _write_ready_file(settings.ready_file, port)
        log.info("serving", port=port)
        await stop.wait()
        log.info("shutting_down", grace_period_s=settings.grace_period_s)
        await health_state.set(False)
        await server.stop(settings.grace_period_s)
    finally:
        await spec.stop()
        await server.stop(0)
    log.info("stopped")
