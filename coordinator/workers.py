"""Clients of the draft and target workers: deadlines, failure mapping, replica choice."""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.adaptive import EWMA_WEIGHT
from coordinator.settings import CoordinatorSettings
from specdec.averages import ewma
from specdec.runtime.grammar import CONSTRAINT_ERROR, NO_GRAMMARS
from specdec.serving.errors import (
    InvalidRequest,
    ReplyTooLarge,
    StartupError,
    WorkerFailed,
    WorkerTimedOut,
    WorkerUnavailable,
)
from specdec.serving.security import ClientSecurity, Reloaded
from specdec.serving.server import channel_options, request_id_metadata
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = structlog.get_logger(__name__)
S = TypeVar("S")
T = TypeVar("T")


class StartupWait:
    """Start-up's wait for something it needs: the time left, and a line that says what is awaited
    (``event`` with ``fields`` and whatever ``tick`` adds) at the first tick (info: workers still
    loading are the usual case), then a warning every 10 s."""

    EVERY_S = 10.0

    def __init__(self, event: str, timeout_s: float, **fields: object) -> None:
        self._event, self._timeout_s, self._fields = event, timeout_s, fields
        self._began = time.monotonic()
        self._next_log = self._began

    @property
    def over(self) -> bool:
        return time.monotonic() - self._began >= self._timeout_s

    def tick(self, **fields: object) -> None:
        """Logs the warning when it is due."""
        now = time.monotonic()
        if now >= self._next_log:
            waited = now - self._began
            emit = log.info if self._next_log == self._began else log.warning
            emit(
                self._event, **self._fields, **fields, waited_s=round(waited, 1),
                gives_up_in_s=round(self._timeout_s - waited, 1),
            )  # fmt: skip
            self._next_log += self.EVERY_S


# A worker that went away is retried quickly once it is back (gRPC's default backoff grows to 2 min).
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A reply over the coordinator's receive limit (gRPC: RESOURCE_EXHAUSTED, "... larger than max
# (N vs. M)") is the request's own limit, not the worker's fault.
_TOO_LARGE = (
    "the target's reply to this request is larger than the coordinator accepts ({}): ask for fewer "
    "prompt_logprobs / top_logprobs, send a shorter prompt, or raise the coordinator's --max-message-bytes"
)
# Codes after which another replica may succeed; anything else is the worker failing the request.
# CANCELLED: the replica (or a proxy on the way) ended the call, as a replica that stops does with
# the calls still arriving; a worker never answers a request's own error with it, and the
# coordinator's own cancellations end its calls with CancelledError, not a status.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}
# Codes that say the worker (or the way to it) is unavailable, not that one request was bad.
_WORKER_FAULTS = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


class WorkerCallFailed(Exception):
    """A draft call failed or timed out (internal: the round falls back to target-only).

    ``worker_fault``: the draft is unreachable, hung or refusing service (every session should
    stop asking it for a while); False when only this request failed (a deterministic error of
    its input, or the caller's own deadline), which must not affect other sessions.
    ``caller_deadline``: the caller's deadline ran out during the call (nothing of the draft's).
    """

    def __init__(self, message: str, worker_fault: bool = True, caller_deadline: bool = False) -> None:
        super().__init__(message)
        self.worker_fault = worker_fault and not caller_deadline
        self.caller_deadline = caller_deadline


async def wait_until_serving(channel: grpc.aio.Channel, role: str, address: str, timeout_s: float) -> None:
    """Polls grpc.health.v1 until the worker reports SERVING; logs every 10 s what it waits for."""
    stub = health_pb2_grpc.HealthStub(channel)
    wait = StartupWait("waiting_for_worker", timeout_s, role=role, address=address)
    last = "no answer"
    while not wait.over:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            last = exc.code().name
        wait.tick(status=last)
        await asyncio.sleep(0.2)
    raise StartupError(
        f"the {role} worker at {address} was not serving after {timeout_s:.0f} s (last status: {last}); check "
        "the address and the worker's log, or give it longer (--worker-startup-timeout-s)"
    )


RETIRE_GRACE_S = 300.0  # calls on a channel replaced by one with renewed credentials get this long to end


class WorkerLink(Generic[S]):
    """The channel to one worker (TLS/mTLS as configured) and the metadata every call carries.
    When the coordinator's TLS files for the workers (CA, client certificate, key) change, the
    calls that follow go over a new channel made with them (grpc's Python channels keep the
    credentials they were made with); calls already made end on the old one, which closes after
    ``RETIRE_GRACE_S``. Files that cannot be read, or a key that does not fit its certificate,
    leave the channel in use."""

    def __init__(self, address: str, settings: CoordinatorSettings, stub_type: Callable[[grpc.aio.Channel], S]) -> None:
        self.address = address
        security = ClientSecurity(
            ca_file=settings.worker_tls_ca_file,
            cert_file=settings.worker_tls_cert_file,
            key_file=settings.worker_tls_key_file,
            server_name=settings.worker_tls_server_name,
            token_file=settings.worker_token_file,
        )
        options = [*channel_options(settings), *_RECONNECT_OPTIONS]
        self.metadata = security.metadata()
        files = [f for f in (security.ca_file, security.cert_file, security.key_file) if f]
        self._channel = Reloaded(
            files, lambda: security.channel(address, options), "worker_tls", "channel", address=address
        )
        self._stub_type = stub_type
        self._stub = stub_type(self.channel)
        self._retired: list[tuple[grpc.aio.Channel, asyncio.Task[None]]] = []

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel.value

    def stub(self) -> S:
        """The stub for the next call (on a new channel once the TLS files changed)."""
        old = self.channel
        if self._channel.renew():
            self._stub = self._stub_type(self.channel)
            self._retired = [(c, t) for c, t in self._retired if not t.done()]
            self._retired.append((old, asyncio.get_running_loop().create_task(old.close(grace=RETIRE_GRACE_S))))
        return self._stub

    async def close(self) -> None:
        for old, closing in self._retired:
            closing.cancel()
            await old.close()
        await self.channel.close()


class _Breaker:
    """Skips a worker for ``retry_s`` after a failure."""

    def __init__(self, retry_s: float) -> None:
        self._retry_s = retry_s
        self._down_until = 0.0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def trip(self) -> None:
        """Down for ``retry_s`` (a worker held until it answers stays held)."""
        self._down_until = max(self._down_until, time.monotonic() + self._retry_s)

    def hold(self) -> None:
        """Down until ``reset``: a worker that has not answered yet."""
        self._down_until = math.inf

    def reset(self) -> None:
        self._down_until = 0.0


class PrefillQueue:
    """The expected milliseconds of the prefills this coordinator's calls have sent one replica and
    not yet had answered. A worker computes long prompts one after another, so a prefill sent now
    waits for these first: its call's time limit allows for them."""

    def __init__(self) -> None:
        self.ahead_ms = 0.0

    @contextmanager
    def holding(self, expected_ms: float) -> Iterator[None]:
        """Counts a call's prefill while the call runs."""
        self.ahead_ms += expected_ms
        try:
            yield
        finally:
            self.ahead_ms = max(self.ahead_ms - expected_ms, 0.0)


class GrammarsRefused(WorkerUnavailable):
    """A target replica does not apply structured-output grammars (it said so, or its verdict on a
    constrained step says nothing of the grammar: a worker older than them): the session's
    constrained steps go to another replica."""


NO_GRAMMAR_REPLICA = (
    "no target worker that applies structured-output constraints is serving now; retry later, or send "
    "the request without sampling.structured_output"
)


OTHERS_FRESH_S = 2.0  # how long a replica's count of the other coordinators' requests is taken as it is


class TargetClient:
    """One target worker replica."""

    role = "target"

    def __init__(self, address: str, settings: CoordinatorSettings, retry_s: float) -> None:
        self.address = address
        self._link = WorkerLink(address, settings, target_pb2_grpc.TargetWorkerStub)
        self.breaker = _Breaker(retry_s)
        self.turns = 0  # this coordinator's turns on the replica now (see ``place``)
        self._others = (-math.inf, 0)  # (when, the other coordinators' requests) as a verify reply counted them
        self.prefills = PrefillQueue()
        self.info = common_pb2.WorkerInfo()
        self.vocabulary = ("", 0)  # (tokenizer hash, vocab size) the coordinator serves; every verify names it
        self.grammars = False  # applies structured-output grammars: its Info, then its answers to constrained steps

    async def connect(self, timeout_s: float) -> common_pb2.WorkerInfo:
        await wait_until_serving(self._link.channel, "target", self.address, timeout_s)
        return await self._read_info(10.0)

    async def _read_info(self, timeout_s: float) -> common_pb2.WorkerInfo:
        """Calls Info; keeps what it says (whether the replica applies grammars included)."""
        request, metadata = target_pb2.TargetInfoRequest(), self._link.metadata()
        self.info = (await self._link.stub().Info(request, timeout=timeout_s, metadata=metadata)).info
        self.grammars = self.info.structured_output
        return self.info

    async def refresh_info(self, timeout_s: float) -> None:
        """Reads the replica's Info again (a restarted replica may apply grammars now, or no
        longer); a replica that does not answer keeps what was known."""
        known = self.grammars
        try:
            await self._read_info(timeout_s)
        except grpc.aio.AioRpcError:
            return
        if self.grammars != known:
            log.info("target_grammars_changed", address=self.address, structured_output=self.grammars)

    async def verify(self, request: target_pb2.VerifyRequest, timeout_s: float) -> target_pb2.VerifyResponse:
        request.tokenizer_hash, request.vocab_size = self.vocabulary
        metadata = (*self._link.metadata(), *request_id_metadata())  # the worker's lines name the request
        reply = await self._call(self._link.stub().Verify(request, timeout=timeout_s, metadata=metadata))
        if request.coordinator_id and reply.cache_status == common_pb2.CACHE_STATUS_OK:
            self._others = (time.monotonic(), max(0, reply.service_requests - request.coordinator_requests))
        return reply

    @property
    def requests(self) -> int:
        """Requests generating on the replica as this coordinator knows them: its own turns there,
        and the other coordinators' as the replica's latest verify reply to any of its turns
        counted them, within OTHERS_FRESH_S (a new turn's first round has heard nothing itself)."""
        at, others = self._others
        return self.turns + (others if time.monotonic() - at <= OTHERS_FRESH_S else 0)

    async def release(self, session_id: str, timeout_s: float) -> bool:
        request = target_pb2.TargetReleaseSessionRequest(session_id=session_id)
        return (
            await self._call(
                self._link.stub().ReleaseSession(request, timeout=timeout_s, metadata=self._link.metadata())
            )
        ).existed

    async def _call(self, call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            log.warning("target_call_failed", address=self.address, code=exc.code().name, details=exc.details())
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise WorkerTimedOut("the target worker is unavailable; retry later") from exc
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (exc.details() or ""):
                sizes = re.search(r"larger than max \((\d+) vs\. (\d+)\)", exc.details() or "")
                size = f"{int(sizes[1]):,} bytes, the limit {int(sizes[2]):,}" if sizes else "over the limit"
                raise ReplyTooLarge(_TOO_LARGE.format(size)) from exc
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and (exc.details() or "").startswith(NO_GRAMMARS):
                raise GrammarsRefused(NO_GRAMMAR_REPLICA) from exc
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # it serves another model (WrongModel)
                log.error("target_serves_another_model", address=self.address, details=exc.details())
                raise WorkerUnavailable("the target worker is unavailable; retry later") from exc
            if exc.code() in _RETRYABLE:
                raise WorkerUnavailable("the target worker is unavailable; retry later") from exc
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(CONSTRAINT_ERROR):
                raise InvalidRequest(details) from exc  # the request's grammar, not the worker
            raise WorkerFailed("the target worker failed while processing the request") from exc

    async def close(self) -> None:
        await self._link.close()


def _rendezvous(session_id: str, address: str) -> bytes:
    return hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest()


class _Replica(Protocol):
    role: str
    address: str
    breaker: _Breaker
    turns: int


R = TypeVar("R", bound=_Replica)
# A replica is clearly busier than the least busy one when it runs more than BUSIER_BY of this
# coordinator's turns more than it, and more than BUSIER_TIMES as many (as SGLang's cache-aware
# router weighs cache hits against balance, with its absolute and relative thresholds).
BUSIER_BY = 2
BUSIER_TIMES = 1.25


def by_affinity(replicas: Sequence[R], session_id: str, current: str | None) -> list[R]:
    """A session's replicas in the order to use them: those up first; among them the one it is on
    (``current``, holding its cache), then the rest by rendezvous hashing of the session id, so
    that every coordinator picks the same one and a lost replica moves only its own sessions."""
    ordered = sorted(replicas, key=lambda r: (r.address != current, _rendezvous(session_id, r.address)))
    return sorted(ordered, key=lambda r: not r.breaker.up)


def place(replicas: Sequence[R], session_id: str, cached: Mapping[str, int]) -> R | None:
    """The replica a session with nothing of its own cached starts on: among those up, the one
    holding the longest cached prefix of its prompt (``cached``: tokens by replica address),
    unless that one is clearly busier than the least busy one, which then computes the prompt
    itself; ties go to the less busy, then by rendezvous hash. So a prefix that every request
    shares (a system prompt) is reused without drawing all of them to the replica that cached it
    first: the others get the overflow, cache the prefix too, and then share it evenly. None when
    no replica is up."""
    up = [r for r in replicas if r.breaker.up]
    if not up:
        return None
    least = min(up, key=lambda r: (r.turns, _rendezvous(session_id, r.address)))
    best = min(up, key=lambda r: (-cached.get(r.address, 0), r.turns, _rendezvous(session_id, r.address)))
    busier = best.turns - least.turns > BUSIER_BY and best.turns > BUSIER_TIMES * least.turns
    return least if busier else best


# What replicas of one deployment share besides the vocabulary (the verify names that).
_ALIKE_FIELDS = ("model_id", "max_context_len", "max_draft_tokens")


def warn_if_unlike(
    event: str,
    address: str,
    info: common_pb2.WorkerInfo,
    first: common_pb2.WorkerInfo,
    fields: Sequence[str],
    effect: str,
) -> None:
    """Logs ``event`` when the replica at ``address`` differs from the first replica that served
    in any of ``fields`` of their Info, naming the fields and both values."""
    differ = [f for f in fields if getattr(info, f) != getattr(first, f)]
    if differ:
        log.warning(
            event, address=address, fields=differ, replica={f: getattr(info, f) for f in differ},
            first={f: getattr(first, f) for f in differ}, effect=effect,
        )  # fmt: skip


class TargetPool:
    """Target replicas. A session sticks to the replica holding its cache; when that one fails it
    moves to the next by rendezvous hashing (so every coordinator picks the same one) and is
    re-prefilled there from the committed tokens."""

    def __init__(
        self,
        addresses: Sequence[str],
        settings: CoordinatorSettings,
        retry_s: float,
        joined: Callable[[], None] | None = None,
    ) -> None:
        """``joined`` is called when a replica that did not serve at start-up joins."""
        self.replicas = [TargetClient(address, settings, retry_s) for address in addresses]
        self._joined = joined
        self._joining: set[asyncio.Task[common_pb2.WorkerInfo | None]] = set()
        self._first: common_pb2.WorkerInfo | None = None  # the Info of the first replica that served

    async def connect(self, timeout_s: float) -> common_pb2.WorkerInfo:
        """Waits until a replica serves and returns its Info. Replicas that have not answered yet
        are not used; each is waited for in the background (up to ``timeout_s``) and joins when it
        serves. Replicas that answer together must share a vocabulary; one that joins later with
        another is not used (every verify names the vocabulary, and it would refuse them)."""
        for replica in self.replicas:
            replica.breaker.hold()
        pending = {asyncio.create_task(self._join(r, timeout_s)) for r in self.replicas}
        infos: list[common_pb2.WorkerInfo] = []
        while pending and not infos:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            infos = [info for task in done if (info := task.result()) is not None]
        self._joining = pending
        if not infos:
            raise StartupError(
                f"no target worker is serving at {', '.join(r.address for r in self.replicas)} after "
                f"{timeout_s:.0f} s; check --target-addresses and the target workers' logs, or give them longer "
                "(--worker-startup-timeout-s)"
            )
        if len({(i.vocab_size, i.tokenizer_hash) for i in infos}) > 1:
            raise StartupError("target replicas serve models with different vocabularies; deploy one model")
        for replica in self.replicas:  # also those not up yet, and any restarted with another model
            replica.vocabulary = (infos[0].tokenizer_hash, infos[0].vocab_size)
        self._first = infos[0]
        for replica in self.replicas:
            if replica.breaker.up:  # joined with the first
                self._compare(replica)
        return infos[0]

    def _compare(self, replica: TargetClient) -> None:
        """Warns when a replica serves another model than the first one that served (one vocabulary
        does not make one model: greedy tokens would depend on the replica a session lands on)."""
        assert self._first is not None
        warn_if_unlike(
            "target_replicas_differ", replica.address, replica.info, self._first, _ALIKE_FIELDS,
            "replies depend on the replica a session is verified on; deploy one model everywhere",
        )  # fmt: skip

    async def _join(self, replica: TargetClient, timeout_s: float) -> common_pb2.WorkerInfo | None:
        """Waits for one replica; from then on it is used, or, if it never served, retried like a
        replica that failed."""
        try:
            info = await replica.connect(timeout_s)
        except (RuntimeError, grpc.aio.AioRpcError) as exc:
            log.warning("target_not_ready", address=replica.address, error=str(exc))
            replica.breaker.reset()
            replica.breaker.trip()
            return None
        replica.breaker.reset()
        if replica.vocabulary[1] and replica.vocabulary != (info.tokenizer_hash, info.vocab_size):
            log.error("target_serves_another_model", address=replica.address, model=info.model_id)
            replica.breaker.trip()
            return None
        log.info("target_joined", address=replica.address, model=info.model_id)
        if self._first is not None:
            self._compare(replica)
            if self._joined is not None:
                self._joined()
        return info

    def get(self, address: str) -> TargetClient | None:
        return next((r for r in self.replicas if r.address == address), None)

    @property
    def grammars(self) -> bool:
        """Some replica that has served applies structured-output grammars."""
        return any(r.grammars for r in self.replicas)

    @property
    def max_draft_tokens(self) -> int:
        """The longest block a replica that has served takes (0: none has said)."""
        return max((r.info.max_draft_tokens for r in self.replicas), default=0)

    async def refresh_info(self, timeout_s: float) -> None:
        """Reads again the Info of every replica that serves (one that has not served yet is being
        waited for, and reads it when it does)."""
        up = [r for r in self.replicas if r.breaker.up]
        results = await asyncio.gather(*(r.refresh_info(timeout_s) for r in up), return_exceptions=True)
        for replica, result in zip(up, results, strict=True):
            if isinstance(result, Exception):  # the next refresh tries again
                log.warning("target_info_refresh_failed", address=replica.address, error=repr(result))

    def candidates(self, session_id: str, current: str | None) -> list[TargetClient]:
        """Replicas to try in order: the current one, then the rest by rendezvous hash; up ones first."""
        return by_affinity(self.replicas, session_id, current)

    async def close(self) -> None:
        for join in self._joining:
            join.cancel()
        await asyncio.gather(*(r.close() for r in self.replicas))


class DraftStream:
    """A session turn's Propose stream (requests in, proposals out, lookahead blocks unasked).

    ``caller_limited``: the timeout passed is the caller's remaining deadline, not the draft's
    patience; running out of it then says nothing about the draft.
    """

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call

    async def send(self, request: draft_pb2.ProposeRequest, timeout_s: float, caller_limited: bool = False) -> None:
        try:
            await asyncio.wait_for(self._call.write(request), timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise self._failed(exc, caller_limited) from exc

    async def receive(self, timeout_s: float, caller_limited: bool = False) -> draft_pb2.ProposeResponse:
        try:
            reply = await asyncio.wait_for(self._call.read(), timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise self._failed(exc, caller_limited) from exc
        if reply is grpc.aio.EOF:
            raise WorkerCallFailed("draft closed the stream")
        return reply

    def _failed(self, exc: BaseException, caller_limited: bool) -> WorkerCallFailed:
        self.cancel()
        if isinstance(exc, grpc.aio.AioRpcError):
            fault = exc.code() in _WORKER_FAULTS
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # it serves another model (WrongModel)
                log.error("draft_serves_another_model", details=exc.details())
                fault = True  # no session can use it: skipped for --draft-retry-s
        elif isinstance(exc, asyncio.TimeoutError) and caller_limited:  # the caller's deadline, not the draft
            return WorkerCallFailed("the caller's deadline ran out during the draft call", caller_deadline=True)
        else:  # the draft is hung
            fault = True
        return WorkerCallFailed(f"draft propose failed: {exc!r}", worker_fault=fault)

    def cancel(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        """Ends the stream of a turn that finished: a half-close, on which the draft drops what it
        drafted ahead and ends the call OK (cancelling it would count a CANCELLED call on the
        draft for every request). What it still sends is read and dropped; a draft that has not
        ended the call within CLOSE_S is cancelled."""
        keep_running(self._close())

    async def _close(self) -> None:
        ended = False
        try:
            async with asyncio.timeout(CLOSE_S):
                await self._call.done_writing()
                while await self._call.read() is not grpc.aio.EOF:
                    pass
            ended = True
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        finally:
            if not ended:
                self._call.cancel()


CLOSE_S = 2.0
# work that no request waits for: streams being closed, what finished turns leave the draft to
# answer and its record in the session state (a reference keeps each task alive)
_BACKGROUND: set[asyncio.Task[Any]] = set()


def keep_running(work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Runs ``work`` as a task that lives until it ends, though nothing awaits it."""
    task = asyncio.get_running_loop().create_task(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


def translates(info: common_pb2.WorkerInfo) -> bool:
    """The draft's tokenizer differs from the target's: it drafts in its own vocabulary and sends
    target ids, possibly fewer than asked for (specdec.runtime.vocab)."""
    return info.vocab_translation in (common_pb2.VOCAB_TRANSLATION_TLI, common_pb2.VOCAB_TRANSLATION_SLEM)


class DraftClient:
    """One draft worker replica; after a failure it is skipped for ``retry_s`` (its sessions move
    to another replica, or decode target-only where none is up)."""

    role = "draft"

    def __init__(self, address: str, settings: CoordinatorSettings, retry_s: float, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._link = WorkerLink(address, settings, draft_pb2_grpc.DraftWorkerStub)
        self.breaker = _Breaker(retry_s)
        self.turns = 0  # this coordinator's turns drafting on the replica now (see ``place``)
        self.prefills = PrefillQueue()
        # prefixes that finished turns left it computing (``WorkerSession.close_stream``), and how
        # many it may be left: as many as this coordinator's turns at once (its work from this
        # coordinator stays within twice what admitted turns can send it)
        self.finishing, self.max_finishing = 0, settings.max_concurrent_requests
        self._latency_s: float | None = None
        self.info = common_pb2.WorkerInfo()
        self.vocab_limit = 0  # the target's vocabulary size, sent with every proposal request
        self.tokenizer_hash = ""  # the target's tokenizer, likewise: the draft refuses requests for another

    async def connect(self, timeout_s: float) -> common_pb2.WorkerInfo:
        await wait_until_serving(self._link.channel, "draft", self.address, timeout_s)
        self.info = (
            await self._link.stub().Info(draft_pb2.DraftInfoRequest(), timeout=10.0, metadata=self._link.metadata())
        ).info
        return self.info

    @property
    def usable(self) -> bool:
        return self.breaker.up

    @property
    def translates(self) -> bool:
        return translates(self.info)

    def observe_latency(self, seconds: float) -> None:
        """Records how long a proposal took to arrive (wall time, load included)."""
        self._latency_s = ewma(self._latency_s, seconds, EWMA_WEIGHT)

    @property
    def patience_s(self) -> float:
        """How long to wait for a proposal: ``timeout_s``, or 3x the recent latency when the draft
        is merely busy (under load proposals queue behind other sessions' passes). A hung draft
        sends nothing, so it cannot stretch this."""
        return self.timeout_s if self._latency_s is None else max(self.timeout_s, 3 * self._latency_s)

    def mark_failed(self, reason: str) -> None:
        log.warning("draft_unavailable", address=self.address, reason=reason)
        self.breaker.trip()

    def open_stream(self) -> DraftStream:
        return DraftStream(self._link.stub().Propose(metadata=(*self._link.metadata(), *request_id_metadata())))

    async def release(self, session_id: str, timeout_s: float) -> bool:
        request = draft_pb2.DraftReleaseSessionRequest(session_id=session_id)
        try:
            return (
                await self._link.stub().ReleaseSession(request, timeout=timeout_s, metadata=self._link.metadata())
            ).existed
        except grpc.aio.AioRpcError as exc:
            log.warning("draft_release_failed", address=self.address, code=exc.code().name)
            return False

    async def close(self) -> None:
        await self._link.close()


class DraftPool:
    """Draft replicas. A session drafts on one: the replica holding its draft cache while that one
    is up, else one chosen by ``place`` (a lost replica moves only its own sessions, whose draft
    caches are rebuilt where they land). A replica is used once it has joined (``join``); one that
    failed is skipped for ``retry_s``."""

    def __init__(
        self, addresses: Sequence[str], settings: CoordinatorSettings, retry_s: float, timeout_s: float
    ) -> None:
        self.replicas = [DraftClient(address, settings, retry_s, timeout_s) for address in addresses]
        for replica in self.replicas:
            replica.breaker.hold()  # until it has answered and fits the target

    @property
    def usable(self) -> bool:
        """A replica can draft now."""
        return any(r.usable for r in self.replicas)

    def get(self, address: str) -> DraftClient | None:
        return next((r for r in self.replicas if r.address == address), None)

    def join(self, replica: DraftClient, target: common_pb2.WorkerInfo) -> None:
        """Uses ``replica`` from now on, telling it the target's vocabulary (sent with every request)."""
        replica.vocab_limit = target.vocab_size
        replica.tokenizer_hash = target.tokenizer_hash
        replica.breaker.reset()

    async def release(self, session_id: str, timeout_s: float) -> None:
        """Frees the session's draft caches on every replica up (best effort)."""
        await asyncio.gather(*(r.release(session_id, timeout_s) for r in self.replicas if r.usable))

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas))
