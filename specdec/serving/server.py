"""gRPC server plumbing shared by every service: errors, health, reflection, lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
import structlog
from grpc._cython import cygrpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specdec.serving.errors import (
    ClientStalled,
    InvalidRequest,
    NotServing,
    PortUnavailable,
    SpecdecError,
    StartupError,
)
from specdec.serving.metrics import RpcMetrics, start_metrics
from specdec.serving.security import Authenticator, ServerTls, caller_identity
from specdec.serving.settings import ServiceSettings

log = structlog.get_logger(__name__)

INTERNAL_MESSAGE = "internal error; the server logged the details"

# A caller's id for its call (gRPC metadata; HTTP's X-Request-Id): a service that takes request ids
# (``ServiceSpec.request_ids``: the coordinator) logs the lines of the call's task with it and sends
# it back in the call's initial metadata; where the caller sent none, it takes the one the request's
# body carries (``RequestIds.in_body``: the engine API's) or makes one up.
REQUEST_ID_KEY = "x-request-id"
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


@dataclass(frozen=True)
class RequestIds:
    """A service's request ids (``_identify``). ``in_body`` reads the id a request's body carries
    ("" where it has none), used where the call has no ``x-request-id`` header and the body's id is
    a valid one (a header value); otherwise the service makes one up."""

    in_body: Callable[[Any], str]


# grpc.health.v1 service names for Kubernetes probes (the health port serves only these).
LIVENESS = "specdec.liveness"  # SERVING while the process works, model loading and draining included
READINESS = "specdec.readiness"  # SERVING while it takes requests: model loaded and not draining
STARTUP = "specdec.startup"  # SERVING once start-up (model loading) has finished

# After the drain: how long calls still in flight (health checks) get to finish; a Watch stream
# is the only call that would use it all.
_STOP_GRACE_S = 0.5
# Once the grace period has run out: how long the cancelled calls get to undo their work and end,
# unless the service says otherwise (``ServiceSpec.cancel_wait_s``: the coordinator's turns roll
# back through the state store).
_CANCEL_WAIT_S = 2.0
# The server's deadline starts when its grpc core reads the call's headers, after the caller's
# did, so the caller's grpc ends the call (a cancel, to the server) with some of the server's
# deadline left: milliseconds on a loaded host (1.5-4.3 ms measured), more across a busy network.
# A caller that leaves within this of the server's deadline ran out of time rather than cancelled.
_DEADLINE_SLACK_S = 0.05


class ServerControl:
    """Process lifecycle: in-flight RPCs, draining, and a stop request with an exit code."""

    def __init__(self) -> None:
        self.stop_requested = asyncio.Event()
        self.exit_code = 0
        self.draining = False
        self.grace_expired = False  # the drain's grace period ran out: in-flight RPCs were cancelled
        self._calls: set[asyncio.Task[Any]] = set()  # the tasks of in-flight RPCs (health excepted)
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        return len(self._calls)

    def request_stop(self, exit_code: int = 0, reason: str = "signal") -> None:
        """Begins a graceful shutdown (idempotent; a non-zero code wins)."""
        log.info("stop_requested", reason=reason, exit_code=exit_code)
        self.exit_code = self.exit_code or exit_code
        self.stop_requested.set()

    def enter(self) -> None:
        """Counts the current task's RPC in (NotServing while draining)."""
        if self.draining:
            raise NotServing("the server is shutting down; retry on another replica")
        self._calls.add(_current_task())
        self._idle.clear()

    def exit(self) -> None:
        self._calls.discard(_current_task())
        if not self._calls:
            self._idle.set()

    async def drain(self, grace_s: float, cancel_wait_s: float) -> bool:
        """Refuses new RPCs and waits for in-flight ones; when the grace period runs out, cancels
        them (each undoes its work as a cancelled call does, then ends UNAVAILABLE) and waits up to
        ``cancel_wait_s`` for them to end. False when the grace period ran out."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return True
        except TimeoutError:
            pass
        self.grace_expired = True
        log.warning("grace_period_expired", cancelling=len(self._calls))
        for task in self._calls:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), cancel_wait_s)
        if self._calls:
            log.warning(
                "calls_outlived_cancel_wait",
                still_running=len(self._calls),
                cancel_wait_s=cancel_wait_s,
                hint="the server's stop ends them with their work left undone: a coordinator turn's session "
                "is undone by its next request once the turn's lease lapses (--session-lease-s); a worker "
                "call's caches go with the process",
            )
        return False


def _current_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None, "an RPC handler runs in a task"
    return task


async def _end_cut_off(context: grpc.aio.ServicerContext) -> None:
    """Ends a call the drain cancelled (its grace period ran out) UNAVAILABLE, saying so (grpc would
    log a handler it has to cancel itself as an error with a traceback); returns only where the
    call had already ended."""
    _current_task().uncancel()
    await _end_with_status(
        context,
        grpc.StatusCode.UNAVAILABLE,
        "the server is shutting down and this call outlived its grace period (--grace-period-s); retry",
    )


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the status ``exc`` maps to; returns only where the call had already ended."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, SpecdecError):
        log.info("rpc_failed", code=exc.code.name, error=str(exc))
        await _end_with_status(context, exc.code, str(exc))
        return
    log.exception("rpc_crashed")
    await _end_with_status(context, grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


async def _end_with_status(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """Ends the call with an error status: raises grpc's AbortError, which grpc takes as the end of
    the handler. Returns only where the send failed because grpc's core had already ended the call
    (the caller's deadline ran out, or it cancelled, as the error was on its way): that failure,
    left to grpc, is logged as an error with a traceback whenever grpc learns of it before it
    learns that the call ended."""
    with contextlib.suppress(*_SEND_FAILED):
        await context.abort(code, details)


def _authenticate(auth: Authenticator, context: grpc.aio.ServicerContext) -> None:
    if auth.enabled:
        caller_identity.set(auth.authenticate(context.invocation_metadata() or (), context.auth_context()))


def request_id_metadata() -> tuple[tuple[str, str], ...]:
    """The current call's request id as metadata for the calls it makes (none outside a call)."""
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    return ((REQUEST_ID_KEY, request_id),) if isinstance(request_id, str) else ()


def _valid_request_id(value: object) -> bool:
    return isinstance(value, str) and _REQUEST_ID.fullmatch(value) is not None


async def _identify(rpc: _Rpc, request: Any, context: grpc.aio.ServicerContext) -> None:
    """Binds the call's request id (the caller's ``x-request-id``, else a valid one in the request's
    body, else a new one) into the log context of the call's task and sends it back as initial
    metadata (services that take ids). Other services (the workers) log the id a caller forwards
    (``request_id_metadata``) as it is."""
    given = next((value for key, value in context.invocation_metadata() or () if key == REQUEST_ID_KEY), None)
    valid = _valid_request_id(given)
    if rpc.request_ids is None:
        if valid:
            structlog.contextvars.bind_contextvars(request_id=given)
        return
    if given is not None and not valid:
        raise InvalidRequest(
            f"{REQUEST_ID_KEY} must be 1-128 printable ASCII characters without spaces (got "
            f"{len(given)} characters); send another one, or none and the server makes one up"
        )
    if given is None and _valid_request_id(in_body := rpc.request_ids.in_body(request)):
        given = in_body
    request_id = given if isinstance(given, str) else uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=request_id)
    with contextlib.suppress(*_SEND_FAILED):  # the call has ended already: its handler finds out
        await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))


@dataclass(frozen=True)
class _Rpc:
    """What a wrapped handler needs besides the handler: its names, the server's state, the checks."""

    path: str  # "service/method", the metrics' label
    name: str  # the method, the log's
    control: ServerControl
    auth: Authenticator
    metrics: RpcMetrics
    request_ids: RequestIds | None = None  # the service takes request ids (_identify)

    def ended(self, context: grpc.aio.ServicerContext, began: float, client_left: bool) -> None:
        code = context.code() or grpc.StatusCode.OK
        if client_left:  # cancelled by the client, or by grpc when the client's deadline ran out
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= _DEADLINE_SLACK_S
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
        self.metrics.ended(self.path, code, began)


def _wrap_unary(fn: Callable[[Any, Any], Awaitable[Any]], rpc: _Rpc) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        began, client_left = time.monotonic(), False
        with structlog.contextvars.bound_contextvars(rpc=rpc.name):
            try:
                _authenticate(rpc.auth, context)
                await _identify(rpc, request, context)
                rpc.control.enter()
                try:
                    return await fn(request, context)
                finally:
                    rpc.control.exit()
            except asyncio.CancelledError:
                if not rpc.control.grace_expired:
                    client_left = True
                    raise  # the client went away
                await _end_cut_off(context)
                client_left = True  # reached only where the call ended before its status was sent
            except Exception as exc:
                await _abort(context, exc)
                client_left = True  # as above
            finally:
                rpc.ended(context, began, client_left)

    return handler


class _ClientLeft(Exception):
    """The call ended (the client cancelled, its deadline passed, its connection broke) before a
    message could be sent."""


# What a write or a status send raises when grpc's core has ended the call but Python was not
# told yet (a cancel that lands between two messages, a deadline that runs out as an error is
# sent): the call is gone, so it is no crash of ours. A private class of grpc's: should a later
# grpc drop it, such a write is logged as a crash again (the cancel test says so), not an import
# error.
_SEND_FAILED: tuple[type[Exception], ...] = tuple(filter(None, [getattr(cygrpc, "ExecuteBatchError", None)]))


async def _write(context: grpc.aio.ServicerContext, item: Any, timeout_s: float) -> None:
    """Sends one stream message; a client that takes none of it within ``timeout_s`` (it stopped
    reading, and flow control holds the write) is ClientStalled. A write that fails because the
    call has ended (the client cancelled between two messages) is _ClientLeft, not a crash."""
    try:
        if not timeout_s:
            await context.write(item)
            return
        await asyncio.wait_for(context.write(item), timeout_s)
    except TimeoutError:
        raise ClientStalled(
            f"the client took no message of this stream for {timeout_s:g} s (it stopped reading); the call was ended"
        ) from None
    except _SEND_FAILED:
        raise _ClientLeft from None


def _wrap_stream(
    fn: Callable[[Any, Any], AsyncIterator[Any]], rpc: _Rpc, write_timeout_s: float
) -> Callable[[Any, Any], Awaitable[None]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> None:
        began, client_left = time.monotonic(), False
        with structlog.contextvars.bound_contextvars(rpc=rpc.name):
            try:
                _authenticate(rpc.auth, context)
                await _identify(rpc, request, context)
                rpc.control.enter()
                try:
                    # closed at once on any way out, so the work behind the stream (a turn) ends now
                    async with contextlib.aclosing(fn(request, context)) as items:
                        first = True
                        async for item in items:
                            if first:  # timed when handed to grpc: a client may take it and cancel first
                                rpc.metrics.first_message(rpc.path, began)
                            first = False
                            await _write(context, item, write_timeout_s)
                finally:
                    rpc.control.exit()
            except asyncio.CancelledError:
                if not rpc.control.grace_expired:
                    client_left = True
                    raise  # the client went away
                await _end_cut_off(context)
                client_left = True  # reached only where the call ended before its status was sent
            except _ClientLeft:
                client_left = True
            except Exception as exc:
                await _abort(context, exc)
                client_left = True  # as above
            finally:
                rpc.ended(context, began, client_left)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """For every service but health: authenticates the caller (identity in ``caller_identity``),
    refuses new RPCs while draining, counts in-flight ones, maps SpecdecError to its status code
    and anything else to a generic INTERNAL, and binds the RPC name into the log context.
    Health passes through untouched (probes carry no credentials).
    """

    def __init__(
        self,
        control: ServerControl,
        metrics: RpcMetrics,
        auth: Authenticator | None = None,
        stream_write_timeout_s: float = 0.0,
        request_ids: RequestIds | None = None,
    ) -> None:
        self._control = control
        self._request_ids = request_ids
        self._auth = auth or Authenticator()
        self._write_timeout_s = stream_write_timeout_s
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(f"/{health.SERVICE_NAME}/"):
            return handler
        rpc = _Rpc(
            method.lstrip("/"), method.rsplit("/", 1)[-1], self._control, self._auth, self._metrics, self._request_ids
        )
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, rpc), **codec)
        if handler.unary_stream:
            wrapped = _wrap_stream(handler.unary_stream, rpc, self._write_timeout_s)
            return grpc.unary_stream_rpc_method_handler(wrapped, **codec)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, rpc), **codec)
        wrapped = _wrap_stream(handler.stream_stream, rpc, self._write_timeout_s)
        return grpc.stream_stream_rpc_method_handler(wrapped, **codec)


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


# gRPC servers bind with SO_REUSEPORT unless told not to: a second process given a port another
# one serves on would bind it too and take some of its connections. Off, that bind fails.
_EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
# Clients may keep an idle connection alive with pings this far apart (the coordinator pings its
# workers every 20 s); grpc's servers allow one in 5 minutes by default and drop the connection
# with GOAWAY "too_many_pings" after the third sooner one.
_PERMITTED_PINGS = ("grpc.http2.min_ping_interval_without_data_ms", 5_000)


def _grpc_server(settings: ServiceSettings | None, interceptor: ErrorInterceptor | None) -> grpc.aio.Server:
    """A server whose ports are its own; with ``settings``, the channel options of the API."""
    options = [*(channel_options(settings) if settings else []), _EXCLUSIVE_PORT, _PERMITTED_PINGS]
    if settings is not None and settings.max_connection_age_s > 0:  # grpc adds +-10% jitter; no grace limit
        options.append(("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)))
    return grpc.aio.server(interceptors=[interceptor] if interceptor else None, options=options)


@dataclass
class ServiceSpec:
    """What a service adds to the shared server."""

    service_names: Sequence[str]
    register: Callable[[grpc.aio.Server], None]
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]
    registry: CollectorRegistry
    # how long calls cancelled at the end of the grace period get to undo their work (``drain``)
    cancel_wait_s: float = _CANCEL_WAIT_S
    request_ids: RequestIds | None = None  # calls carry request ids (REQUEST_ID_KEY): the public API's


class Health:
    """The grpc.health.v1 servicer: the process's service names, "" and READINESS flip together
    with readiness; LIVENESS and STARTUP have their own meaning (see their definitions)."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self._names = ["", *service_names, READINESS]

    async def set(self, serving: bool) -> None:
        for name in self._names:
            await self.servicer.set(name, _status(serving))

    async def set_probe(self, name: str, serving: bool) -> None:
        await self.servicer.set(name, _status(serving))


def _status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


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
    if (failure := start.exception()) is not None:  # a traceback only where no message explains it
        log.error("startup_failed", error=str(failure), exc_info=None if isinstance(failure, StartupError) else failure)
        control.exit_code = 1
        return False
    return True


def _authenticator(settings: ServiceSettings) -> Authenticator:
    return Authenticator(None, settings.tls_allowed_client_names, settings.auth_tokens_file)


def _server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    if not (settings.tls_cert_file and settings.tls_key_file):
        return None
    return ServerTls(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file).credentials()


def _bind(server: grpc.aio.Server, address: str, tls: grpc.ServerCredentials | None = None) -> int:
    """Binds ``address`` (port 0: any free port); returns the port bound."""
    try:
        return server.add_secure_port(address, tls) if tls else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's own message only says to turn on its debug log
        raise PortUnavailable(f"could not bind {address}; is the port in use?") from exc


def _local_server(
    spec: ServiceSpec, settings: ServiceSettings, control: ServerControl, health_state: Health, metrics: RpcMetrics
) -> grpc.aio.Server | None:
    """The same services on a loopback-only plaintext port (``local_port``), for a sidecar in
    the same pod: only processes sharing the network namespace reach it, so its callers need no
    token (they share the anonymous session namespace)."""
    if settings.local_port is None:
        return None
    interceptor = ErrorInterceptor(
        control, metrics, stream_write_timeout_s=settings.stream_write_timeout_s, request_ids=spec.request_ids
    )
    local = _grpc_server(settings, interceptor)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, local)
    spec.register(local)
    return local


def _health_server(health_state: Health, settings: ServiceSettings) -> grpc.aio.Server | None:
    """A plaintext server with only grpc.health.v1 on ``health_port`` (probes need no TLS or token)."""
    if settings.health_port is None:
        return None
    probes = _grpc_server(None, None)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, probes)
    return probes


async def serve(settings: ServiceSettings, spec: ServiceSpec, control: ServerControl) -> int:
    """Runs a service until SIGTERM/SIGINT or a fatal error; returns the process exit code.

    Health is NOT_SERVING until ``spec.start`` (e.g. model loading) has finished. On shutdown
    health flips to NOT_SERVING at once and stays queryable, new RPCs get UNAVAILABLE, and
    in-flight ones have the grace period to finish.
    """
    try:
        auth = _authenticator(settings)
        credentials = _server_credentials(settings)
    except ValueError as exc:
        log.error("invalid_security_settings", error=str(exc))
        return 2
    metrics = RpcMetrics(spec.registry)
    interceptor = ErrorInterceptor(control, metrics, auth, settings.stream_write_timeout_s, spec.request_ids)
    server = _grpc_server(settings, interceptor)
    health_state = Health(spec.service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    spec.register(server)
    reflection.enable_server_reflection([*spec.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    local = _local_server(spec, settings, control, health_state, metrics)
    probes = _health_server(health_state, settings)
    try:  # every port is bound before any is served
        ports = {"port": _bind(server, f"{settings.host}:{settings.port}", credentials)}
        if local is not None and settings.local_port is not None:
            ports["local_port"] = _bind(local, f"127.0.0.1:{settings.local_port}")
        if probes is not None:
            ports["health_port"] = _bind(probes, f"{settings.host}:{settings.health_port or 0}")
        ports.update(start_metrics(settings, spec.registry))
    except PortUnavailable as exc:
        log.error("startup_failed", error=str(exc))
        for unused in (server, local, probes):
            if unused is not None:
                await unused.stop(None)
        return 1
    await health_state.set(False)
    await health_state.set_probe(STARTUP, False)
    await health_state.set_probe(LIVENESS, True)
    for serving in (server, local, probes):
        if serving is not None:
            await serving.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, control.request_stop)
    log.info("server_started", services=list(spec.service_names), tls=bool(settings.tls_cert_file), **ports)
    going: list[asyncio.Task[None]] = []
    try:
        if await _start_or_stop(spec, control):
            await health_state.set_probe(STARTUP, True)
            await health_state.set(True)
            if settings.ready_file:
                _write_ready_file(settings.ready_file, ports)
            log.info("serving", **ports)
            await control.stop_requested.wait()
        log.info("shutting_down", grace_period_s=settings.grace_period_s, inflight=control.inflight)
        await health_state.set(False)
        # Clients are told to go (HTTP/2 GOAWAY on every connection): a call sent after it is
        # refused by grpc before any handler runs, and the client sends it again over a new
        # connection, which leads to another replica (gRPC channels keep their connection, so a
        # Service or load balancer steers only new ones). The calls in flight go on, under the
        # drain, which ends them; grpc's own stop has no deadline of its own (one of its own could
        # cut a call still rolling back, with grpc's words): the stop below, after the drain, ends
        # what is left.
        going += [asyncio.create_task(serving.stop(math.inf)) for serving in (server, local) if serving is not None]
        drained = await control.drain(settings.grace_period_s, spec.cancel_wait_s)
        log.info("drained" if drained else "calls_cancelled", still_running=control.inflight)
    finally:
        # the drain has ended every call but health checks; those still in flight get to answer
        # (stopping with no grace cancels them, and grpc logs each as an error with a traceback)
        for stopping in (server, local, probes):
            if stopping is not None:
                await stopping.stop(_STOP_GRACE_S)
        await asyncio.gather(*going, return_exceptions=True)
        await spec.stop()
    log.info("stopped", exit_code=control.exit_code)
    return control.exit_code


def run_service(service: Coroutine[Any, Any, int]) -> NoReturn:
    """Runs a service's ``serve`` to its end and exits the process with its exit code.

    Once the service has shut down (in-flight calls drained, workers and stores closed, the last
    log line written) nothing is left to do, so neither the event loop nor the interpreter is torn
    down. The interpreter's teardown collects the whole torch / transformers object graph, which
    took 0.8-2.5 s per process on a 2-core host, time a stopping pod or a restart would wait out.
    The loop's (closing the runner, as ``asyncio.run`` does) cancels the tasks still pending, and
    grpc's own task for a call it has just cancelled at the stop may be one: grpc logs such a
    cancellation as an unhandled error and prints its traceback to stderr, outside the JSON log.
    A service that fails (raises) exits the usual way, with its traceback.
    """
    code = asyncio.Runner().run(service)  # never closed: see above
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
