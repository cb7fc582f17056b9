"""What the draft and target workers share: model, caches, model thread, Info, input checks."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import structlog
import torch
from prometheus_client import CollectorRegistry

from specdec.errors import InvalidRequest, SpecdecError, WorkerUnavailable
from specdec.kvcache import SessionCaches
from specdec.metrics import WorkerMetrics
from specdec.modeling import LoadedModel, load_model
from specdec.sampling import Warp
from specdec.server import ModelThread, ServerControl
from specdec.settings import ModelWorkerSettings
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)
T = TypeVar("T")


class WorkerCore:
    """A model plus its per-session caches, driven from one model thread.

    An unexpected exception in the model thread fails that request with a generic INTERNAL
    and takes the worker out of service (health NOT_SERVING, graceful exit with status 1), so
    that the orchestrator restarts it rather than it serving from a possibly corrupt state.
    """

    def __init__(self, settings: ModelWorkerSettings, control: ServerControl, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.thread = ModelThread()
        self.instance_id = uuid.uuid4().hex
        self.metrics = WorkerMetrics(registry)
        self._control = control
        self._loaded: LoadedModel | None = None
        self._caches: SessionCaches | None = None

    async def load(self) -> None:
        """Loads the model in the model thread (the server answers health checks meanwhile)."""
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        s = self.settings
        self._loaded = await self.thread.run(load_model, s.model, s.device, s.dtype, s.trust_remote_code)
        caches = SessionCaches(self._loaded, s.max_sessions, s.session_idle_s)
        self.metrics.cached_sessions.set_function(lambda: len(caches))
        self._caches = caches

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs model work in the model thread, applying the crash policy above."""
        try:
            return await self.thread.run(fn, *args)
        except SpecdecError:
            raise
        except Exception:
            self.metrics.model_errors.inc()
            log.exception("model_error")
            self._control.request_stop(exit_code=1, reason="model error")
            raise

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
        )

    def check_request(self, session_id: str, base_len: int, tail: Sequence[int], extra_positions: int) -> None:
        """Rejects a sync request that no correct coordinator sends."""
        if not session_id:
            raise InvalidRequest("session_id is required")
        if not tail:
            raise InvalidRequest("tail_token_ids must hold at least the last committed token")
        vocab = self.loaded.vocab_size
        if max(tail) >= vocab:
            raise InvalidRequest(f"token id {max(tail)} is out of range: the vocabulary has {vocab} ids")
        end = base_len + len(tail) + extra_positions
        if end > self.loaded.max_context_len:
            raise InvalidRequest(f"{end} positions exceed the model's context length {self.loaded.max_context_len}")

    async def release(self, session_id: str) -> bool:
        return await self.compute(self.caches.release, session_id)

    def close(self) -> None:
        self.thread.shutdown()


def warp_from_proto(warp: common_pb2.WarpParams) -> Warp:
    """WarpParams -> Warp; unset top_p (0) means off."""
    try:
        return Warp(temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p or 1.0)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def warp_to_proto(warp: Warp) -> common_pb2.WarpParams:
    return common_pb2.WarpParams(temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p)
