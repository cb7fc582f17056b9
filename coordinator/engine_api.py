"""The vLLM engine gRPC protocol (``vllm.grpc.engine.VllmEngine``, PyPI ``smg-grpc-proto``) on the
coordinator's port, so that an OpenAI-compatible gateway (the Shepherd Model Gateway, ``smg``)
routes to specdec as to a vLLM worker: it tokenizes, applies chat templates and serves
``/v1/chat/completions``; we generate, exactly, with speculation.

Each request is mapped to the native API's request and validated by the same code (structured
outputs included: JSON schema, JSON object, regex, grammar, choice); what the native API cannot do
(structural tags, multimodal input, KV transfer, embeddings) is INVALID_ARGUMENT or UNIMPLEMENTED,
never silently ignored. vLLM semantics where they differ from
ours: an unset temperature is 1.0 (ours: greedy), top_p / repetition_penalty 0 mean unset.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import secrets
import tempfile
import time
import zipfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
import structlog
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from coordinator.engine import Engine
from coordinator.servicer import reply_room, reply_too_large, round_bytes
from coordinator.turn import Finish, RoundOutput, Turn, tokenize
from coordinator.validation import check_prompt_chars, parse_request_off_loop
from specdec.serving.errors import InvalidRequest, Unsupported
from specdec.serving.security import caller_identity
from specdec.v1 import common_pb2, coordinator_pb2

log = structlog.get_logger(__name__)

SERVICE_NAME = vllm_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
MAX_N = 16
_CHUNK_BYTES = 64 * 1024
_FINISH = {Finish.STOP: "stop", Finish.LENGTH: "length"}


def _unsupported(request: vllm_pb2.GenerateRequest) -> str | None:
    """What the request asks for that this server cannot do, if anything."""
    params = request.sampling_params
    if params.WhichOneof("constraint") == "structural_tag":
        return "structured output (structural_tag) is not supported by this server"
    if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
        return "multimodal input is not supported by this server (text models only)"
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        return "KV transfer (disaggregated prefill/decode) is not supported by this server"
    return None


async def _prompt_ids(request: vllm_pb2.GenerateRequest, engine: Engine) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        ids = list(request.tokenized.input_ids)
    elif kind == "text":
        check_prompt_chars("text has", len(request.text), engine.limits)
        ids = await asyncio.to_thread(tokenize, engine.deps.tokenizer, request.text)  # off the event loop
    else:
        raise InvalidRequest("the request has no input: set `tokenized` or `text`")
    params = request.sampling_params
    if params.HasField("truncate_prompt_tokens") and params.truncate_prompt_tokens != 0:
        keep = params.truncate_prompt_tokens
        if keep < -1:
            raise InvalidRequest(f"truncate_prompt_tokens must be -1 or >= 1, got {keep}")
        ids = ids[-(engine.limits.max_context_len - 1 if keep == -1 else keep) :]
    return ids


def gateway_request_id(request: object) -> str:
    """The id a Generate request's body carries: the gateway's for the request (smg sends no
    x-request-id; its id is the OpenAI reply's ``id``), so the coordinator's lines of the request
    and the call's initial metadata carry the id the gateway's client was given. "" for others."""
    return request.request_id if isinstance(request, vllm_pb2.GenerateRequest) else ""


def _derived_seed(seed: int, index: int) -> int:
    """Completion ``index``'s seed: the request's own for index 0, independent ones for the rest."""
    if index == 0:
        return seed % 2**64
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# The native request's field names in an error message, and what the engine protocol (and the
# OpenAI API behind the gateway) calls those fields; in this order.
_ENGINE_NAMES = (
    ("sampling.max_new_tokens", "max_tokens"),
    ("max_new_tokens", "max_tokens"),
    ("sampling.top_logprobs", "logprobs"),
    ("prompt_token_ids", "tokenized.input_ids"),
    ("sampling.structured_output.", ""),
    ("sampling.structured_output", "the constraint"),
    ("sampling.", ""),
)


def _in_engine_terms(error: InvalidRequest) -> InvalidRequest:
    """``error`` with the fields named as the engine-API caller named them."""
    message = str(error)
    for native, engine in _ENGINE_NAMES:
        message = message.replace(native, engine)
    return type(error)(message)


_TOP_K_MAX = 2**31 - 1  # the native top_k's largest value


def native_request(
    request: vllm_pb2.GenerateRequest, prompt: Sequence[int], index: int
) -> coordinator_pb2.GenerateRequest:
    """The native (specdec.v1) request of completion ``index`` of an engine-API request."""
    p = request.sampling_params
    sampling = common_pb2.SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        # unsigned here, signed 32-bit natively: past 2^31 - 1 (vLLM's -1, "off", sent unsigned, or
        # more than any vocabulary holds) it filters nothing, as 2^31 - 1 does
        top_k=min(p.top_k, _TOP_K_MAX),
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        # as sent: the protocol's false (also a client's that leaves it out) keeps special tokens'
        # text for stop strings, as vLLM's engine does; the gateway sends true unless asked
        skip_special_tokens=p.skip_special_tokens,
    )
    if p.top_p:
        sampling.top_p = p.top_p
    if p.repetition_penalty:
        sampling.repetition_penalty = p.repetition_penalty
    if p.HasField("max_tokens"):
        sampling.max_new_tokens = p.max_tokens
    for token, bias in p.logit_bias.items():
        if token < 0:
            raise InvalidRequest(f"logit_bias has the negative token id {token}")
        sampling.logit_bias[token] = bias
    if p.HasField("seed"):
        sampling.seed = _derived_seed(p.seed, index)
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name) and getattr(p, name) < 0:
            raise InvalidRequest(f"{name} = {getattr(p, name)} (all) is not supported: ask for at most 20")
    if p.HasField("logprobs"):
        sampling.logprobs, sampling.top_logprobs = True, p.logprobs
    if p.HasField("prompt_logprobs"):
        sampling.prompt_logprobs = p.prompt_logprobs
    constraint = p.WhichOneof("constraint")
    if constraint == "choice":
        sampling.structured_output.choice.values.extend(p.choice.choices)
    elif constraint is not None:  # json_schema, regex, grammar, json_object: the same names
        setattr(sampling.structured_output, constraint, getattr(p, constraint))
    return coordinator_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling)


def _tops(entries: Sequence[common_pb2.TokenLogprob]) -> list[vllm_pb2.TopLogProbs]:
    return [
        vllm_pb2.TopLogProbs(values=[t.logprob for t in e.top], token_ids=[t.token_id for t in e.top]) for e in entries
    ]


def _output_logprobs(entries: Sequence[common_pb2.TokenLogprob]) -> vllm_pb2.OutputLogProbs:
    return vllm_pb2.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=_tops(entries),
    )


def _input_logprobs(entries: Sequence[common_pb2.TokenLogprob]) -> vllm_pb2.InputLogProbs:
    """The first token of a session has no logprob: its entry's value is unset."""
    return vllm_pb2.InputLogProbs(
        token_logprobs=[
            vllm_pb2.InputTokenLogProb(value=e.logprob) if e.HasField("logprob") else vllm_pb2.InputTokenLogProb()
            for e in entries
        ],
        token_ids=[e.token_id for e in entries],
        top_logprobs=_tops(entries),
    )


@dataclass
class _Completion:
    """What one of the n completions has produced so far."""

    turn: Turn
    tokens: list[int]
    logprobs: list[common_pb2.TokenLogprob]
    prompt_logprobs: list[common_pb2.TokenLogprob]
    room: int  # how large its non-streaming reply may grow (reply_room)
    first: bool = True
    size: int = 0  # what a non-streaming reply has grown to (round_bytes)


_ABORTED = object()


class VllmEngineServicer(vllm_grpc.VllmEngineServicer):
    """``vllm.grpc.engine.VllmEngine`` over the coordinator's engine (same port, TLS and tokens)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._started = time.monotonic()
        # (caller, request id) -> the running completions' tasks: like session ids, request ids
        # are the caller's own, so one caller's Abort never reaches another's request
        self._running: dict[tuple[str, str], list[asyncio.Task[None]]] = {}
        self._throughput = (time.monotonic(), 0.0)
        self._tokenizer_zip: tuple[bytes, str] | None = None

    async def Generate(
        self, request: vllm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_pb2.GenerateResponse]:
        problem = _unsupported(request)
        if problem is not None:
            raise InvalidRequest(problem)
        n = request.sampling_params.n or 1
        if n > MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
        engine = self._engine
        prompt = await _prompt_ids(request, engine)
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        seed = request.sampling_params.seed if request.sampling_params.HasField("seed") else secrets.randbits(31)
        completions = []
        for index in range(n):
            native = native_request(request, prompt, index)
            if not request.sampling_params.HasField("seed"):
                native.sampling.seed = _derived_seed(seed, index)
            try:
                parsed = await parse_request_off_loop(native, engine.limits)
            except InvalidRequest as exc:
                raise _in_engine_terms(exc) from None
            turn = engine.new_turn(parsed, deadline)
            completions.append(_Completion(turn, [], [], [], reply_room(turn, engine)))
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        # Completion 0 runs first; the others start once its first round is done, from its caches
        # (the prompt is computed once, as vLLM's parallel sampling does).
        tasks = [asyncio.create_task(self._run(0, completions[0].turn, queue))]
        waiting = list(enumerate(completions))[1:]
        request_id = (caller_identity.get(), request.request_id)
        self._running.setdefault(request_id, []).extend(tasks)
        try:
            pending = n
            while pending:
                index, item = await queue.get()
                if waiting and index == 0:
                    if isinstance(item, RoundOutput) and not tasks[0].cancelling():
                        for _, c in waiting:
                            c.turn.prefix_donor = completions[0].turn
                        started = [asyncio.create_task(self._run(i, c.turn, queue)) for i, c in waiting]
                        tasks += started
                        self._running.setdefault(request_id, []).extend(started)
                    elif not isinstance(item, BaseException):  # aborted before its first round ended
                        for i, _ in waiting:
                            queue.put_nowait((i, _ABORTED))
                    waiting = []
                if isinstance(item, InvalidRequest):  # the reply does not fit the context
                    raise _in_engine_terms(item) from None
                if isinstance(item, BaseException):
                    raise item
                completion = completions[index]
                if item is _ABORTED:
                    pending -= 1
                    yield self._complete(completion, index, "abort", [], request.stream)
                    continue
                assert isinstance(item, RoundOutput)
                completion.tokens += item.token_ids
                completion.logprobs += item.logprobs
                completion.prompt_logprobs += item.prompt_logprobs
                if request.stream:
                    yield self._chunk(completion, index, item)
                else:  # the completion's one message must fit the message limit: end it before it cannot
                    completion.size += round_bytes(item)
                    if item.finish is None and completion.size > completion.room:
                        raise reply_too_large(engine, "a streaming request (stream = true)")
                if item.finish is not None:
                    pending -= 1
                    yield self._complete(completion, index, _FINISH[item.finish], item.token_ids, request.stream)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            left = [t for t in self._running.get(request_id, []) if t not in tasks]
            if left:
                self._running[request_id] = left
            else:
                self._running.pop(request_id, None)

    async def _run(self, index: int, turn: Turn, queue: asyncio.Queue[tuple[int, object]]) -> None:
        """Runs one completion, reporting each round (or the error, or an abort) on ``queue``."""
        try:
            async with self._engine.admitted():
                async for out in turn.rounds():
                    queue.put_nowait((index, out))
        except asyncio.CancelledError:
            queue.put_nowait((index, _ABORTED))
            raise
        except Exception as exc:  # the Generate stream fails with it
            queue.put_nowait((index, exc))

    @staticmethod
    def _chunk(completion: _Completion, index: int, out: RoundOutput) -> vllm_pb2.GenerateResponse:
        stats = completion.turn.stats
        chunk = vllm_pb2.GenerateStreamChunk(
            token_ids=out.token_ids,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=len(out.token_ids),
            cached_tokens=stats.cached_tokens,
            index=index,
        )
        if completion.turn.request.logprobs:
            chunk.output_logprobs.CopyFrom(_output_logprobs(out.logprobs))
        if completion.first and completion.turn.request.prompt_logprobs is not None:
            chunk.input_logprobs.CopyFrom(_input_logprobs(completion.prompt_logprobs))
        completion.first = False
        return vllm_pb2.GenerateResponse(chunk=chunk)

    @staticmethod
    def _complete(
        completion: _Completion, index: int, reason: str, last: list[int], stream: bool
    ) -> vllm_pb2.GenerateResponse:
        """The completion's end. Streaming: the chunks carried the tokens (the gateway adds them
        up) and this repeats the last chunk's, as vLLM does; otherwise all of them."""
        turn, stats = completion.turn, completion.turn.stats
        tokens = last if stream else completion.tokens
        complete = vllm_pb2.GenerateComplete(
            output_ids=tokens,
            finish_reason=reason,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=len(tokens),
            cached_tokens=stats.cached_tokens,
            index=index,
            spec_accepted_tokens=stats.accepted,
            spec_draft_tokens=stats.proposed,
        )
        if turn.request.logprobs:
            entries = completion.logprobs[len(completion.logprobs) - len(tokens) :] if stream else completion.logprobs
            complete.output_logprobs.CopyFrom(_output_logprobs(entries))
        if not stream and turn.request.prompt_logprobs is not None:
            complete.input_logprobs.CopyFrom(_input_logprobs(completion.prompt_logprobs))
        if turn.stop_string is not None:
            complete.matched_stop_str = turn.stop_string
        elif turn.stop_token_id is not None:
            complete.matched_token_id = turn.stop_token_id
        return vllm_pb2.GenerateResponse(complete=complete)

    async def Abort(self, request: vllm_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> vllm_pb2.AbortResponse:
        """Cancels the caller's named requests' turns: each is rolled back and its caches freed, as
        for a cancelled native stream (the gateway sends this on a client disconnect)."""
        caller = caller_identity.get()
        for request_id in request.request_ids:
            for task in self._running.get((caller, request_id), []):
                task.cancel()
        return vllm_pb2.AbortResponse()

    async def HealthCheck(
        self, request: vllm_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.HealthCheckResponse:
        """Healthy when start-up is done and a target replica is usable."""
        ready = self._engine.ready and any(r.breaker.up for r in self._engine.targets.replicas)
        return vllm_pb2.HealthCheckResponse(healthy=ready, message="ok" if ready else "no target worker is ready")

    async def GetModelInfo(
        self, request: vllm_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.GetModelInfoResponse:
        info, tokenizer, settings = self._engine.info, self._engine.deps.tokenizer, self._engine.settings
        return vllm_pb2.GetModelInfoResponse(
            model_path=info.target_model_id,
            is_generation=True,
            max_context_length=info.max_context_len,
            vocab_size=info.vocab_size,
            served_model_name=settings.served_model_name or info.target_model_id,
            tokenizer_path=settings.tokenizer or info.target_model_id,
            eos_token_ids=list(info.eos_token_ids),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else -1,
            bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else -1,
            max_req_input_len=info.max_context_len - 1,
        )

    async def GetServerInfo(
        self, request: vllm_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.GetServerInfoResponse:
        return vllm_pb2.GetServerInfoResponse(
            active_requests=self._engine.active,
            uptime_seconds=time.monotonic() - self._started,
            server_type="specdec",
            data_parallel_size=1,
            max_num_seqs=self._engine.settings.max_concurrent_requests,
            constrained_decoding_start="first_token" if self._engine.limits.structured_output else "",
        )

    async def GetLoads(
        self, request: vllm_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.GetLoadsResponse:
        engine = self._engine
        limit = engine.settings.max_concurrent_requests
        now, total = time.monotonic(), engine.generated_tokens
        then, before = self._throughput
        self._throughput = (now, total)
        load = vllm_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=engine.active,
            num_total_reqs=engine.active,
            max_running_requests=limit,
            utilization=engine.active / limit,
            gen_throughput=(total - before) / (now - then) if now > then else 0.0,
        )
        return vllm_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=engine.info.server_version, dp_rank_count=1, loads=[load]
        )

    async def Embed(self, request: vllm_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> vllm_pb2.EmbedResponse:
        raise Unsupported("embeddings are not supported by this server (a generation service)")

    async def FlushCache(
        self, request: smg_common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> smg_common_pb2.FlushCacheResponse:
        raise Unsupported("cache flushing is not supported: sessions' caches are freed by CloseSession or expiry")

    async def StartProfile(
        self, request: smg_common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> smg_common_pb2.ProfileResponse:
        raise Unsupported("profiling is not supported by this server")

    async def StopProfile(
        self, request: smg_common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> smg_common_pb2.ProfileResponse:
        raise Unsupported("profiling is not supported by this server")

    async def SubscribeKvEvents(
        self, request: smg_common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common_pb2.KvEventBatch]:
        """KV events are not published (the gateway then polls GetLoads)."""
        raise Unsupported("KV cache events are not published by this server; poll GetLoads")
        yield  # an async generator, as the streaming RPC needs

    async def GetTokenizer(
        self, request: smg_common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common_pb2.GetTokenizerChunk]:
        """The coordinator's tokenizer (the target's) as a zip, in chunks; sha256 on the last."""
        if self._tokenizer_zip is None:
            self._tokenizer_zip = await asyncio.to_thread(_tokenizer_zip, self._engine.deps.tokenizer)
        data, digest = self._tokenizer_zip
        for start in range(0, len(data), _CHUNK_BYTES):
            end = min(start + _CHUNK_BYTES, len(data))
            yield smg_common_pb2.GetTokenizerChunk(data=data[start:end], sha256=digest if end == len(data) else "")


def _tokenizer_zip(tokenizer: object) -> tuple[bytes, str]:
    """The tokenizer's files (as ``save_pretrained`` writes them) zipped, and the zip's sha256."""
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="specdec-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(Path(tmp).iterdir()):
                if path.is_file():
                    archive.write(path, path.name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()
