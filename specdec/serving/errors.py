"""Domain errors. One server interceptor maps them to gRPC status codes (specdec.serving.server)."""

from __future__ import annotations

import grpc


class SpecdecError(Exception):
    """An error whose message is safe to show to the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(SpecdecError):
    """The request is malformed; the message says which field and what is allowed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class RequestTooLarge(SpecdecError):
    """The request is larger than the server accepts."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ReplyTooLarge(RequestTooLarge):
    """A worker's reply to this request is larger than the coordinator accepts (its own limit,
    not a worker fault)."""


class Overloaded(SpecdecError):
    """The server is at its admission limit; retry with backoff."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class SessionNotFound(SpecdecError):
    """The named session does not exist (or has expired)."""

    code = grpc.StatusCode.NOT_FOUND


class SessionBusy(SpecdecError):
    """Another request is generating in the same session."""

    code = grpc.StatusCode.ABORTED


class StateConflict(SpecdecError):
    """The session's state changed under this request (a concurrent or stale writer)."""

    code = grpc.StatusCode.ABORTED


class SessionGone(StateConflict):
    """The session was closed (CloseSession) or expired while this request was using it."""


class StateUnavailable(SpecdecError):
    """The state store cannot be reached, or lost its data."""

    code = grpc.StatusCode.UNAVAILABLE


class StateUnreachable(StateUnavailable):
    """No connection to the state store could be made or kept (refused, reset, timed out): it may
    come up later, unlike a store that refuses the coordinator (a wrong password)."""


class StateStoreFull(SpecdecError):
    """The state store is at its memory limit and refuses what would grow it (Redis's maxmemory
    with noeviction): this request cannot be saved; what frees memory still works."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class TooManySessions(SpecdecError):
    """The caller holds as many sessions as the coordinator allows one caller
    (--max-sessions-per-caller): a new one waits until one is closed or expires."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class TooManySessionTokens(SpecdecError):
    """The caller's sessions hold as many tokens as the coordinator keeps for one caller
    (--max-session-tokens-per-caller): its turns wait until sessions are closed or expire."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class WorkerUnavailable(SpecdecError):
    """No model worker that can serve the request is reachable."""

    code = grpc.StatusCode.UNAVAILABLE


class WrongModel(SpecdecError):
    """The worker serves a model of another vocabulary than the caller's (a replica restarted with
    another model): it must not serve this caller."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceeded(SpecdecError):
    """The request's own deadline expired while a worker was working on it."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ClientStalled(SpecdecError):
    """The client took none of a stream's messages for too long (it stopped reading)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class WorkerTimedOut(WorkerUnavailable):
    """A worker call ran out of time (the worker is slow or hung, or the caller's deadline hit)."""


class WorkerFailed(SpecdecError):
    """A model worker failed while processing the request (details only in the logs)."""

    code = grpc.StatusCode.INTERNAL


class RequestFailed(SpecdecError):
    """A worker could not process this one request (an error outside the model's forward pass);
    the worker keeps serving. Details only in the worker's log."""

    code = grpc.StatusCode.INTERNAL


class NumericalError(SpecdecError):
    """Sampling met non-finite numbers for this request (the worker keeps serving)."""

    code = grpc.StatusCode.INTERNAL


class StateLost(SpecdecError):
    """The state store lost the session's data (e.g. restarted without persistence)."""

    code = grpc.StatusCode.ABORTED


class NotServing(SpecdecError):
    """The server is starting up or shutting down and takes no requests now."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(SpecdecError):
    """The call carries no valid credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SpecdecError):
    """The caller is known but may not use this service."""

    code = grpc.StatusCode.PERMISSION_DENIED


class GrammarsUnavailable(SpecdecError):
    """This worker does not apply structured-output grammars (turned off, or its tokenizer is not
    one llguidance reads): a coordinator sends the request's constrained steps to another replica."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Unsupported(SpecdecError):
    """An RPC this server does not offer."""

    code = grpc.StatusCode.UNIMPLEMENTED


class PortUnavailable(Exception):
    """A port the service was told to serve on cannot be bound (another process has it, or the
    address is not this host's); the service does not start."""


class StartupError(RuntimeError):
    """Start-up cannot go on, for a reason the message explains along with what to do (workers
    that never served, models that do not fit together): logged without a traceback."""
