"""gRPC server plumbing shared by every service: errors, health, reflection, lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specdec.errors import NotServing, SpecdecError
from specdec.metrics import start_metrics
from specdec.settings import ServiceSettings

log = structlog.get_logger(__name__)

INTERNAL_MESSAGE = "internal error; the server logged the details"


class ServerControl:
    """Process lifecycle: in-flight RPC count, draining, and a stop request with an exit code."""

    def __init__(self) -> None:
        self.stop_requested = asyncio.Event()
        self.exit_code = 0
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def request_stop(self, exit_code: int = 0, reason: str = "signal") -> None:
        """Begins a graceful shutdown (idempotent; a non-zero code wins)."""
        log.info("stop_requested", reason=reason, exit_code=exit_code)
        self.exit_code = self.exit_code or exit_code
        self.stop_requested.set()

    def enter(self) -> None:
        if self.draining:
            raise NotServing("the server is shutting down; retry on another replica")
        self.inflight += 1
        self._idle.clear()

    def exit(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def drain(self, grace_s: float) -> bool:
        """Refuses new RPCs and waits for in-flight ones; False when the grace period ran out."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return True
        except asyncio.TimeoutError:
            return False


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, SpecdecError):
        log.info("rpc_failed", code=exc.code.name, error=str(exc))
        await context.abort(exc.code, str(exc))
    log.exception("rpc_crashed")
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def _wrap_unary(
    fn: Callable[[Any, Any], Awaitable[Any]], method: str, control: ServerControl
) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with structlog.contextvars.bound_contextvars(rpc=method):
            try:
                control.enter()
                try:
                    return await fn(request, context)
                finally:
                    control.exit()
            except Exception as exc:
                await _abort(context, exc)

    return handler


def _wrap_stream(
    fn: Callable[[Any, Any], AsyncIterator[Any]], method: str, control: ServerControl
) -> Callable[[Any, Any], AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with structlog.contextvars.bound_contextvars(rpc=method):
            try:
                control.enter()
                try:
                    async for item in fn(request, context):
                        yield item
                finally:
                    control.exit()
            except Exception as exc:
                await _abort(context, exc)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """For specdec's own services: refuses new RPCs while draining, counts in-flight ones, maps
    SpecdecError to its status code and anything else to a generic INTERNAL, and binds the RPC
    name into the log context. Health and reflection pass through untouched.
    """

    def __init__(self, control: ServerControl) -> None:
        self._control = control

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith("/specdec."):
            return handler
        name, control = method.rsplit("/", 1)[-1], self._control
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, name, control), **codec)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, name, control), **codec)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, name, control), **codec)
        return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, name, control), **codec)


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
    registry: CollectorRegistry


class Health:
    """The grpc.health.v1 servicer with all of a process's service names flipped together."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self._names = ["", *service_names]

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            await self.servicer.set(name, status)


def _write_ready_file(path: str, ports: dict[str, int]) -> None:
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps({**ports, "pid": os.getpid()}))
    tmp.replace(target)


async def _start_or_stop(spec: ServiceSpec, control: ServerControl) -> bool:
    """Runs ``spec.start``; False when a stop was requested first or start-up failed."""
    start = asyncio.ensure_future(spec.start())
    stop = asyncio.ensure_future(control.stop_requested.wait())
    await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not start.done():
        start.cancel()
        return False
    if start.exception() is not None:
        log.error("startup_failed", error=str(start.exception()), exc_info=start.exception())
        control.exit_code = 1
        return False
    return True


async def serve(settings: ServiceSettings, spec: ServiceSpec, control: ServerControl) -> int:
    """Runs a service until SIGTERM/SIGINT or a fatal error; returns the process exit code.

    Health is NOT_SERVING until ``spec.start`` (e.g. model loading) has finished. On shutdown
    health flips to NOT_SERVING at once and stays queryable, new RPCs get UNAVAILABLE, and
    in-flight ones have the grace period to finish.
    """
    server = grpc.aio.server(interceptors=[ErrorInterceptor(control)], options=channel_options(settings))
    health_state = Health(spec.service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    spec.register(server)
    reflection.enable_server_reflection([*spec.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {settings.host}:{settings.port}; is the port in use?")
    await health_state.set(False)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, control.request_stop)
    ports = {"port": port, **start_metrics(settings, spec.registry)}
    log.info("server_started", services=list(spec.service_names), **ports)
    try:
        if await _start_or_stop(spec, control):
            await health_state.set(True)
            if settings.ready_file:
                _write_ready_file(settings.ready_file, ports)
            log.info("serving", **ports)
            await control.stop_requested.wait()
        log.info("shutting_down", grace_period_s=settings.grace_period_s, inflight=control.inflight)
        await health_state.set(False)
        drained = await control.drain(settings.grace_period_s)
        log.info("drained" if drained else "grace_period_expired", inflight=control.inflight)
    finally:
        await server.stop(0)
        await spec.stop()
    log.info("stopped", exit_code=control.exit_code)
    return control.exit_code
