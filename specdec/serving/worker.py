"""What the draft and target workers share: model, caches, model thread, Info, input checks."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch
from prometheus_client import CollectorRegistry

from specdec.runtime.grammar import NO_GRAMMARS
from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadedModel, load_model
from specdec.runtime.scheduler import HostLock, Job, ModelFault, StepScheduler
from specdec.runtime.startup import PrefillRates, auto_token_budget, prefill_rates
from specdec.serving.errors import (
    GrammarsUnavailable,
    InvalidRequest,
    RequestFailed,
    SpecdecError,
    StartupError,
    WorkerUnavailable,
    WrongModel,
)
from specdec.serving.metrics import WorkerMetrics
from specdec.serving.server import ServerControl
from specdec.serving.session_ids import INTERNAL_SESSION_ID_MAX, check_session_id
from specdec.serving.settings import ModelWorkerSettings
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)
T = TypeVar("T")

# How long a draft's proposal waits for a grammar it does not hold yet: most compile in a few ms,
# a large schema for about a second (3,000 properties: 0.9 s), which under load outlasts the
# coordinator's patience with a proposal.
DRAFT_GRAMMAR_WAIT_S = 0.1


def cpu_quota(proc_cgroup: str, cgroup_root: Path) -> int | None:
    """The whole CPUs this process's cgroup quota allows (at least 1; a Kubernetes pod's
    ``limits.cpu``), read from ``proc_cgroup`` (/proc/self/cgroup's text) under ``cgroup_root``
    (v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None when there is none."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mount, names = cgroup_root, ("cpu.max",)
        elif "cpu" in controllers.split(","):
            mount, names = cgroup_root / "cpu", ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        # the process's own cgroup, or the mount's root (a container sees its cgroup there)
        for folder in (mount / path.lstrip("/"), mount):
            try:
                fields = " ".join((folder / name).read_text() for name in names).split()
            except OSError:
                continue
            try:
                return None if fields[0] in ("max", "-1") else max(1, int(fields[0]) // int(fields[1]))
            except (ValueError, IndexError):
                return None
    return None


def _default_threads() -> int:
    """torch's default CPU threads (the host's cores), at most what the CPU quota lets run."""
    try:
        quota = cpu_quota(Path("/proc/self/cgroup").read_text(), Path("/sys/fs/cgroup"))
    except OSError:
        quota = None
    default = torch.get_num_threads()
    return min(default, quota or default)


class WorkerCore:
    """A model plus its per-session caches, driven by one model thread (a StepScheduler).

    A request's own errors (bad input, non-finite numbers, any exception in its job's code) fail
    that request only: its session cache is dropped (the next request re-syncs it) and the worker
    keeps serving. An exception inside the model's forward pass, or one that ends the model
    thread (ModelFault), is a model/device fault: the requests in that pass (or all waiting) fail
    with a generic INTERNAL and the worker leaves service (health NOT_SERVING, graceful exit with
    status 1), so that the orchestrator restarts it rather than it serving from a possibly corrupt
    state.
    """

    def __init__(self, settings: ModelWorkerSettings, control: ServerControl, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.scheduler = StepScheduler(
            settings.max_batch, HostLock(settings.cpu_lock_file), batch_wait_s=settings.batch_wait_ms / 1000
        )
        self.instance_id = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.metrics = WorkerMetrics(registry)
        self._control = control
        self._loaded: LoadedModel | None = None
        self._caches: SessionCaches | None = None
        self._background: set[asyncio.Future[bool]] = set()
        self._compiling: dict[str, asyncio.Future[object]] = {}  # grammars compiling, by text
        self.prefill = PrefillRates(0.0, 0.0)  # measured once the model is loaded

    async def load(self) -> None:
        """Loads the model in the model thread (the server answers health checks meanwhile)."""
        s = self.settings
        threads = s.torch_threads or _default_threads()
        if threads != torch.get_num_threads():
            await self.scheduler.call(torch.set_num_threads, threads)
        log.info("torch_threads", threads=threads, configured=bool(s.torch_threads))
        try:
            self._loaded = await self.scheduler.call(load_model, s.model, s.load_options())
        except ValueError as exc:  # what the model, device or options given get wrong, said with the fix
            raise StartupError(str(exc)) from exc
        budget = s.max_cache_tokens or await self.scheduler.call(auto_token_budget, self._loaded)
        log.info("cache_budget", max_cache_tokens=budget, automatic=not s.max_cache_tokens)
        caches = await self.scheduler.call(
            SessionCaches, self._loaded, s.max_sessions, s.session_idle_s, budget, s.rollback_margin()
        )  # in the model thread: a windowed model's share of memory is measured on a pass
        log.info("lean_step", on=caches.lean is not None)  # one-token steps without the model's forward
        self.metrics.cached_sessions.set_function(lambda: len(caches))
        self.metrics.cached_tokens.set_function(lambda: caches.cached_tokens)
        self.metrics.cache_budget_tokens.set(budget)
        began = time.perf_counter()
        widest = await self.scheduler.call(caches.warm_up, min(s.warm_up_widths, s.max_draft_tokens + 1))
        log.info("widths_warmed_up", widths=widest, ms=round((time.perf_counter() - began) * 1000, 1))
        self.prefill = await self.scheduler.call(prefill_rates, self._loaded, s.rollback_margin(), widest > 0)
        log.info(
            "prefill_measured",
            ms_per_token=round(self.prefill.per_token_ms, 3),
            ms_per_token_per_1k_context=round(self.prefill.per_1k_context_ms, 3),
        )
        chunk = s.prefill_chunk(self._loaded.device.type)
        log.info("prefill_chunk", tokens=chunk, configured=bool(s.prefill_chunk_tokens))
        self.scheduler.attach(caches, chunk)
        self._caches = caches

    async def run(self, session_id: str, start: Callable[[], Job[T]]) -> T:
        """Runs a job in the model thread, applying the crash policy above.

        A job its caller abandons (client gone, deadline) that found no cache for its session and
        made one leaves it to be freed: its request may have arrived after the coordinator's
        ReleaseSession for the session (sent earlier, scheduled later), and nothing else would free
        that cache before the idle timeout.
        """
        fresh = False

        def tracked() -> Job[T]:  # runs in the model thread when the job starts
            nonlocal fresh
            fresh = session_id not in self.caches
            return start()

        try:
            return await self._guard(self.scheduler.run(session_id, tracked))
        except SpecdecError:
            if self._caches is not None:  # the session's cache may hold a half-done step: drop it
                await self.scheduler.call(self._caches.release, session_id)
            raise
        except asyncio.CancelledError:
            if fresh:
                self._release_later(session_id)
            raise

    def _release_later(self, session_id: str) -> None:
        """Frees a session's cache in the model thread without waiting for it."""
        task = asyncio.ensure_future(self.scheduler.call(self.caches.release, session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a plain function in the model thread, applying the crash policy above."""
        return await self._guard(self.scheduler.call(fn, *args))

    async def _guard(self, work: Awaitable[T]) -> T:
        try:
            return await work
        except SpecdecError:
            raise
        except ModelFault:
            self.metrics.model_errors.inc()
            log.exception("model_error")
            self._control.request_stop(exit_code=1, reason="model error")
            raise
        except Exception as exc:
            self.metrics.request_errors.inc()
            log.exception("request_error")
            raise RequestFailed("the worker could not process this request; the worker's log has the details") from exc

    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise WorkerUnavailable("the model is still loading; retry when health reports SERVING")
        return self._loaded

    @property
    def caches(self) -> SessionCaches:
        if self._caches is None:
            raise WorkerUnavailable("the model is still loading; retry when health reports SERVING")
        return self._caches

    def check_vocabulary(self, tokenizer_hash: str, vocab_size: int, wire_tokenizer_hash: str = "") -> None:
        """Refuses a caller that serves another vocabulary than the ids this worker speaks: its
        model's, or ``wire_tokenizer_hash`` (a draft that translates to the target's ids). Empty / 0:
        the caller did not say."""
        m = self.loaded
        speaks = wire_tokenizer_hash or m.tokenizer_hash
        if (tokenizer_hash and tokenizer_hash != speaks) or (vocab_size and vocab_size != m.vocab_size):
            raise WrongModel(
                f"this worker serves {m.model_id!r} (tokenizer {speaks}, {m.vocab_size} ids) but the caller serves "
                f"tokenizer {tokenizer_hash or '?'} with {vocab_size or '?'} ids: every worker must serve the models "
                "the coordinator started with (one model on every target replica); restart the coordinator after "
                "changing them"
            )

    def info(self) -> common_pb2.WorkerInfo:
        m = self.loaded
        return common_pb2.WorkerInfo(
            model_id=m.model_id,
            vocab_size=m.vocab_size,
            tokenizer_hash=m.tokenizer_hash,
            device=str(m.device),
            dtype=str(m.dtype).removeprefix("torch."),
            max_context_len=m.max_context_len,
            eos_token_ids=list(m.eos_token_ids),
            instance_id=self.instance_id,
            active_sessions=len(self.caches),
            prefill_tokens_total=self.caches.prefill_tokens_total,
            host=self.host,
            batched_forwards=self.scheduler.batched_forwards,
            batched_requests=self.scheduler.batched_requests,
            reused_tokens_total=self.caches.reused_tokens_total,
            cache_idle_s=self.settings.session_idle_s,
            prefill_ms_per_token=self.prefill.per_token_ms,
            prefill_ms_per_token_per_1k_context=self.prefill.per_1k_context_ms,
            structured_output=self.loaded.grammar is not None and not self.loaded.grammar.failed,
        )

    async def prepare_grammar(self, grammar: str, *, required: bool = False) -> bool:
        """Compiles a request's structured-output grammar off the model thread (kept for the
        job, which would otherwise compile it there while every other session waits); requests
        asking for the same grammar meanwhile share one compile. Whether the job can mask with it.

        ``required`` (the target, whose masks make the output exact): waits for the compile; a
        worker that does not apply grammars refuses the request here, before any model work.
        Otherwise (the draft, whose masks only raise acceptance): waits at most
        ``DRAFT_GRAMMAR_WAIT_S``; a grammar still compiling then goes on compiling for the rounds
        after, and this one proposes unmasked."""
        masks = self.loaded.grammar
        if not grammar:
            return False
        if masks is None or masks.failed:
            if required:
                raise GrammarsUnavailable(f"{NO_GRAMMARS} (turned off, or its tokenizer is not one llguidance reads)")
            return False
        if masks.holds(grammar):
            return True
        compiling = self._compiling.get(grammar)
        if compiling is None:
            compiling = asyncio.ensure_future(asyncio.to_thread(masks.compile, grammar))
            self._compiling[grammar] = compiling
            compiling.add_done_callback(lambda done: self._compiled(grammar, done))
        try:  # shielded: a caller that leaves or stops waiting leaves the compile to the others
            await (
                asyncio.shield(compiling)
                if required
                else asyncio.wait_for(asyncio.shield(compiling), DRAFT_GRAMMAR_WAIT_S)
            )
        except TimeoutError:
            return False
        return True

    def _compiled(self, grammar: str, done: asyncio.Future[object]) -> None:
        self._compiling.pop(grammar, None)
        if not done.cancelled():
            done.exception()  # retrieved here: a caller that stopped waiting never reads it

    def check_request(
        self,
        session_id: str,
        sync: common_pb2.PrefixSync,
        extra_positions: int,
        vocab_size: int | None = None,
        check_context: bool = True,
    ) -> None:
        """Rejects a sync request that no correct coordinator sends; ids are checked against
        ``vocab_size`` (default: the model's output size)."""
        check_session_id(session_id, INTERNAL_SESSION_ID_MAX)
        if sync.source_session_id:
            check_session_id(sync.source_session_id, INTERNAL_SESSION_ID_MAX)
        base_len, tail = sync.base_len, sync.tail_token_ids
        if not tail:
            raise InvalidRequest("tail_token_ids must hold at least the last committed token")
        vocab = vocab_size or self.loaded.vocab_size
        if max(tail) >= vocab:
            raise InvalidRequest(f"token id {max(tail)} is out of range: the vocabulary has {vocab} ids")
        end = base_len + len(tail) + extra_positions
        if check_context and end > self.loaded.max_context_len:
            raise InvalidRequest(f"{end} positions exceed the model's context length {self.loaded.max_context_len}")

    async def release(self, session_id: str) -> bool:
        check_session_id(session_id, INTERNAL_SESSION_ID_MAX)
        return await self.call(self.caches.release, session_id)

    def close(self) -> None:
        self.scheduler.stop()
