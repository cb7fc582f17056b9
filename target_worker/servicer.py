"""TargetWorker gRPC servicer: wire <-> domain."""

from __future__ import annotations

import grpc

from specdec.runtime.logprobs import MAX_TOP_LOGPROBS, LogprobsAsk
from specdec.runtime.processing import processing_from_proto
from specdec.runtime.proposals import warp_from_proto
from specdec.serving.errors import InvalidRequest
from specdec.serving.worker import WorkerCore
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_worker.engine import verify_job
from target_worker.load import ServiceLoad
from target_worker.settings import TargetSettings


class TargetServicer(target_pb2_grpc.TargetWorkerServicer):
    def __init__(self, core: WorkerCore, settings: TargetSettings) -> None:
        self._core = core
        self._settings = settings
        self._load = ServiceLoad()

    async def Info(
        self, request: target_pb2.TargetInfoRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.TargetInfoResponse:
        info = self._core.info()
        info.max_draft_tokens = self._settings.max_draft_tokens
        return target_pb2.TargetInfoResponse(info=info)

    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        self._core.check_vocabulary(request.tokenizer_hash, request.vocab_size)
        k = len(request.draft.token_ids)
        if k > self._settings.max_draft_tokens:
            raise InvalidRequest(
                f"draft block of {k} tokens exceeds max_draft_tokens={self._settings.max_draft_tokens}"
            )
        self._core.check_request(request.session_id, request.sync, k)
        if max(request.top_logprobs, request.prompt_top_logprobs) > MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"at most {MAX_TOP_LOGPROBS} top logprobs per token")
        service_requests = self._load.report(request.coordinator_id, request.coordinator_requests)
        warp, core = warp_from_proto(request.warp), self._core
        processing = processing_from_proto(request.processing)
        await core.prepare_grammar(processing.grammar, required=True)
        ask = LogprobsAsk(
            request.logprobs, request.top_logprobs, request.prompt_logprobs_count, request.prompt_top_logprobs
        )
        result = await core.run(
            request.session_id,
            lambda: verify_job(
                core.caches,
                core.loaded,
                request.session_id,
                request.sync,
                request.draft,
                warp,
                request.seed,
                processing,
                ask,
            ),
        )
        if result.resync:
            core.metrics.resyncs.inc()
            return target_pb2.VerifyResponse(
                cache_status=common_pb2.CACHE_STATUS_RESYNC_REQUIRED, resync_from=result.resync_from
            )
        core.metrics.computed_tokens.inc(result.computed_tokens)
        core.metrics.compute_seconds.observe(result.compute_ms / 1000)
        return target_pb2.VerifyResponse(
            cache_status=common_pb2.CACHE_STATUS_OK,
            num_accepted=result.num_accepted,
            token_ids=list(result.token_ids),
            cache_len=result.cache_len,
            computed_tokens=result.computed_tokens,
            compute_ms=result.compute_ms,
            logprobs=result.logprobs,
            prompt_logprobs=result.prompt_logprobs,
            constrained=bool(processing.grammar),  # verify_job masked every row, or raised
            service_requests=service_requests,
        )

    async def ReleaseSession(
        self, request: target_pb2.TargetReleaseSessionRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.TargetReleaseSessionResponse:
        return target_pb2.TargetReleaseSessionResponse(existed=await self._core.release(request.session_id))
