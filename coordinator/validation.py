"""GenerateRequest -> TurnRequest: every check that needs no worker and no session state."""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.adaptive import NO_STOP, ConfidenceStop, drafting_method
from specdec.runtime.grammar import grammar_of
from specdec.runtime.logprobs import MAX_TOP_LOGPROBS
from specdec.runtime.processing import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, NO_PROCESSING, Processing
from specdec.runtime.sampling import Warp
from specdec.serving.errors import InvalidRequest, RequestTooLarge
from specdec.serving.session_ids import check_session_id
from specdec.v1 import common_pb2, coordinator_pb2

# The GenerateRequest fields parse_request honours (GetInfo lists them as the server's features).
FEATURES = (
    "session_id",
    "prompt",
    "prompt_token_ids",
    "sampling.max_new_tokens",
    "sampling.temperature",
    "sampling.top_k",
    "sampling.top_p",
    "sampling.seed",
    "sampling.stop_token_ids",
    "sampling.ignore_eos",
    "sampling.stop",
    "sampling.include_stop_str_in_output",
    "sampling.skip_special_tokens",
    "sampling.logprobs",
    "sampling.top_logprobs",
    "sampling.prompt_logprobs",
    "sampling.min_tokens",
    "sampling.repetition_penalty",
    "sampling.presence_penalty",
    "sampling.frequency_penalty",
    "sampling.min_p",
    "sampling.logit_bias",
    "sampling.structured_output",
    "messages",
    "speculation.num_speculative_tokens",
    "speculation.disable",
    "speculation.fixed",
    "speculation.method",
    "speculation.draft_confidence",
    "speculation.draft_block_confidence",
    "require_existing_session",
)


@dataclass(frozen=True)
class Limits:
    """What the deployed models and settings allow."""

    vocab_size: int
    max_context_len: int
    eos_token_ids: frozenset[int]
    default_max_new_tokens: int
    default_k: int
    max_k: int
    max_prompt_chars: int
    draft_context_len: int = 0  # the draft's context length (0 = no draft); it drafts no further
    default_method: str = "ngram"  # model | ngram | hybrid
    lookup_max_tokens: int = 8  # the most tokens one lookup draft proposes
    draft_confidence: float = 0.0  # the draft's confidence stops when a request sets none
    draft_block_confidence: float = 0.0
    draft_block_confidence_from_costs: bool = False  # the server's block stop follows the measured costs
    structured_output: bool = False  # the target workers apply grammars (WorkerInfo.structured_output)


@dataclass(frozen=True)
class TurnRequest:
    """A validated request: what to append, how to sample, how to speculate."""

    session_id: str  # "" = one-shot
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    max_new_tokens: int  # when the caller left it unset: the server default, cut to the context's room
    warp: Warp
    seed: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    include_stop_str: bool
    k: int
    fixed_k: bool
    require_existing: bool
    method: str  # who drafts: model | ngram | hybrid (see coordinator.adaptive)
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content), instead of a prompt
    min_tokens: int = 0
    processing: Processing = NO_PROCESSING  # the turn sets reply_start; banned_until_min = stop_ids
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # alternatives per prompt token; None = no prompt logprobs
    draft_stop: ConfidenceStop = NO_STOP  # where the draft model ends a block early
    max_new_tokens_set: bool = True  # False: the server's default, which the turn caps at the room left
    skip_special: bool = True  # special tokens' text left out of the reply's text and stop matching


def _check_ids(ids: Iterable[int], vocab_size: int, field: str) -> None:
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise InvalidRequest(
            f"{field} contains token id {bad[0]}, but the vocabulary has {vocab_size} ids (0..{vocab_size - 1})"
        )


MAX_MESSAGES = 1024


def check_prompt_chars(what: str, chars: int, limits: Limits, counted: str = "") -> None:
    """Text to tokenize (or render) is held to ``max_prompt_chars`` before any work is done on it;
    ``counted`` says what the count covers, where that is not plain."""
    if chars > limits.max_prompt_chars:
        raise RequestTooLarge(f"{what} {chars} characters{counted}; the limit is {limits.max_prompt_chars}")


def _messages(request: coordinator_pb2.GenerateRequest, limits: Limits) -> tuple[tuple[str, str], ...]:
    if request.WhichOneof("input") is not None:
        raise InvalidRequest("set either `messages` or a prompt (`prompt` / `prompt_token_ids`), not both")
    if len(request.messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages has {len(request.messages)} entries; at most {MAX_MESSAGES} are allowed")
    chars = sum(len(m.role) + len(m.content) for m in request.messages)  # both are rendered and tokenized
    check_prompt_chars("the messages have", chars, limits, " (roles and contents)")
    for index, message in enumerate(request.messages):
        if not message.role:
            raise InvalidRequest(f"messages[{index}].role is empty; use e.g. 'system', 'user' or 'assistant'")
    return tuple((m.role, m.content) for m in request.messages)


def _prompt(request: coordinator_pb2.GenerateRequest, limits: Limits) -> tuple[str | None, tuple[int, ...] | None]:
    kind = request.WhichOneof("input")
    if kind == "prompt" and request.prompt:
        check_prompt_chars("prompt has", len(request.prompt), limits)
        return request.prompt, None
    if kind == "prompt_token_ids" and request.prompt_token_ids.ids:
        ids = tuple(request.prompt_token_ids.ids)
        _check_ids(ids, limits.vocab_size, "prompt_token_ids")
        if len(ids) >= limits.max_context_len:
            raise InvalidRequest(
                f"prompt_token_ids has {len(ids)} tokens; the context length is {limits.max_context_len}"
            )
        return None, ids
    raise InvalidRequest(
        "the prompt is empty: set `prompt` (text), `prompt_token_ids` (at least one id) or `messages` (chat)"
    )


def _warp(sampling: common_pb2.SamplingParams) -> Warp:
    temperature = sampling.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if sampling.top_k < 0:
        raise InvalidRequest(f"sampling.top_k must be >= 0 (0 = off), got {sampling.top_k}")
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {top_p}")
    if not (0.0 <= sampling.min_p <= 1.0):
        raise InvalidRequest(f"sampling.min_p must be in [0, 1] (0 = off), got {sampling.min_p}")
    return Warp(temperature=temperature, top_k=sampling.top_k, top_p=top_p, min_p=sampling.min_p)


MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


def _processing(sampling: common_pb2.SamplingParams, limits: Limits, stop_ids: frozenset[int]) -> Processing:
    repetition = sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0
    if not (MIN_REPETITION_PENALTY <= repetition <= MAX_REPETITION_PENALTY):
        raise InvalidRequest(
            f"sampling.repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
            f"(1 = off), got {repetition}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not (-MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidRequest(
                f"sampling.{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {value}"
            )
    bias = sampling.logit_bias
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(
            f"sampling.logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
        )
    _check_ids(bias.keys(), limits.vocab_size, "sampling.logit_bias")
    for token, value in bias.items():
        if not (-MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequest(
                f"sampling.logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}"
            )
    return Processing(
        repetition_penalty=repetition,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        logit_bias=tuple(sorted(bias.items())),
        min_tokens=sampling.min_tokens,
        banned_until_min=tuple(sorted(stop_ids)),
        grammar=_grammar(sampling, limits) if sampling.HasField("structured_output") else "",
    )


def _grammar(sampling: common_pb2.SamplingParams, limits: Limits) -> str:
    """The constraint's grammar, checked, and refused where it cannot be honoured exactly."""
    field = "sampling.structured_output"
    if not limits.structured_output:
        raise InvalidRequest(
            f"{field} needs target workers that apply grammars, and this server's do not (started with "
            "--no-structured-output, their tokenizer is not one llguidance reads, or they run an older specdec); "
            "send the request without it"
        )
    grammar = grammar_of(sampling.structured_output, field)
    if not grammar:
        raise InvalidRequest(f"{field} is set but holds no constraint; set one of its fields or leave it unset")
    if sampling.ignore_eos:
        raise InvalidRequest(f"{field} cannot be combined with ignore_eos: the constraint ends the reply when complete")
    if sampling.min_tokens:
        raise InvalidRequest(f"{field} cannot be combined with min_tokens: the constraint decides where the reply ends")
    return grammar


def _logprobs(sampling: common_pb2.SamplingParams) -> tuple[int, int | None]:
    """(top_logprobs, prompt_logprobs), checked."""
    if sampling.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"sampling.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {sampling.top_logprobs}")
    if sampling.top_logprobs and not sampling.logprobs:
        raise InvalidRequest("sampling.top_logprobs needs sampling.logprobs = true")
    prompt = sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None
    if prompt is not None and prompt > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"sampling.prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {prompt}")
    return sampling.top_logprobs, prompt


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def _stop_strings(sampling: common_pb2.SamplingParams) -> tuple[str, ...]:
    stops = tuple(sampling.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling.stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for stop in stops:
        if not 0 < len(stop) <= MAX_STOP_CHARS:
            raise InvalidRequest(
                f"every sampling.stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(stop)}"
            )
    return stops


def _max_new_tokens(sampling: common_pb2.SamplingParams, limits: Limits) -> int:
    if not sampling.HasField("max_new_tokens"):
        return limits.default_max_new_tokens
    n = sampling.max_new_tokens
    if n == 0 or n >= limits.max_context_len:
        raise InvalidRequest(f"sampling.max_new_tokens must be in [1, {limits.max_context_len - 1}], got {n}")
    return n


def _k(speculation: coordinator_pb2.SpeculationParams, limits: Limits, stop: ConfidenceStop) -> int:
    """The request's K. Unset, it is the server's default K, except where a confidence stop of the
    draft ends the blocks of an adaptive request: K then only caps them, at ``max_k`` (as HF's
    assisted generation drafts up to 20 tokens until its confidence threshold ends the block). A
    server whose default K is 0 does not speculate unless the request asks for a K."""
    if speculation.disable:
        return 0
    k = speculation.num_speculative_tokens
    if k > limits.max_k:
        raise InvalidRequest(f"speculation.num_speculative_tokens must be <= {limits.max_k}, got {k}")
    if k:
        return k
    capped_by_the_stop = stop.on and not speculation.fixed and limits.default_k > 0
    return limits.max_k if capped_by_the_stop else limits.default_k


_METHODS = {
    coordinator_pb2.DRAFT_METHOD_MODEL: "model",
    coordinator_pb2.DRAFT_METHOD_NGRAM: "ngram",
    coordinator_pb2.DRAFT_METHOD_HYBRID: "hybrid",
}


def _method(speculation: coordinator_pb2.SpeculationParams, limits: Limits) -> str:
    if speculation.method == coordinator_pb2.DRAFT_METHOD_UNSPECIFIED:
        return limits.default_method
    if speculation.method not in _METHODS:
        raise InvalidRequest(f"speculation.method {speculation.method} is not one of MODEL, NGRAM, HYBRID")
    return drafting_method(_METHODS[speculation.method], limits.draft_context_len > 0)


def _draft_stop(speculation: coordinator_pb2.SpeculationParams, limits: Limits) -> ConfidenceStop:
    """The request's confidence stops: each as the request sets it, else the server's (none with
    ``fixed``, which asks for exactly K); the server's block stop follows the measured costs where
    the server says so (``draft_block_confidence_from_costs``)."""

    def threshold(name: str, default: float) -> float:
        if not speculation.HasField(name):
            return 0.0 if speculation.fixed else default
        value = getattr(speculation, name)
        if not 0.0 <= value < 1.0:  # NaN fails too
            raise InvalidRequest(f"speculation.{name} must be in [0, 1), got {value}")
        return float(value)

    block = threshold("draft_block_confidence", limits.draft_block_confidence)
    return ConfidenceStop(
        token=threshold("draft_confidence", limits.draft_confidence),
        block=block,
        block_from_costs=limits.draft_block_confidence_from_costs
        and block > 0
        and not speculation.HasField("draft_block_confidence"),
    )


async def parse_request_off_loop(request: coordinator_pb2.GenerateRequest, limits: Limits) -> TurnRequest:
    """``parse_request``, in a worker thread when the request has a structured-output constraint:
    checking a large schema takes a few hundred ms, which would hold up every other call."""
    if request.sampling.HasField("structured_output"):
        return await asyncio.to_thread(parse_request, request, limits)
    return parse_request(request, limits)


def parse_request(request: coordinator_pb2.GenerateRequest, limits: Limits) -> TurnRequest:
    """Validates a request; raises InvalidRequest naming the offending field."""
    if request.session_id:
        check_session_id(request.session_id)
    if request.require_existing_session and not request.session_id:
        raise InvalidRequest("require_existing_session needs a session_id")
    messages = _messages(request, limits) if request.messages else None
    prompt_text, prompt_ids = _prompt(request, limits) if messages is None else (None, None)
    sampling = request.sampling
    _check_ids(sampling.stop_token_ids, limits.vocab_size, "sampling.stop_token_ids")
    stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else limits.eos_token_ids)
    max_new_tokens = _max_new_tokens(sampling, limits)
    if sampling.min_tokens > max_new_tokens:
        raise InvalidRequest(
            f"sampling.min_tokens ({sampling.min_tokens}) must not exceed max_new_tokens ({max_new_tokens})"
        )
    if sampling.min_tokens and len(stop_ids) >= limits.vocab_size:
        raise InvalidRequest(
            f"min_tokens would ban every token: until the reply has {sampling.min_tokens} tokens the stop "
            f"tokens (sampling.stop_token_ids and, unless ignore_eos, the end-of-sequence ids) are banned, "
            f"and they cover all {limits.vocab_size} ids; leave some ids out or set min_tokens to 0"
        )
    top_logprobs, prompt_logprobs = _logprobs(sampling)
    draft_stop = _draft_stop(request.speculation, limits)
    return TurnRequest(
        session_id=request.session_id,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        max_new_tokens_set=sampling.HasField("max_new_tokens"),
        warp=_warp(sampling),
        seed=sampling.seed if sampling.HasField("seed") else secrets.randbits(63),
        stop_ids=stop_ids,
        stop_strings=_stop_strings(sampling),
        include_stop_str=sampling.include_stop_str_in_output,
        skip_special=sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
        k=_k(request.speculation, limits, draft_stop),
        fixed_k=request.speculation.fixed,
        require_existing=request.require_existing_session,
        method=_method(request.speculation, limits),
        messages=messages,
        min_tokens=sampling.min_tokens,
        processing=_processing(sampling, limits, stop_ids),
        logprobs=sampling.logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        draft_stop=draft_stop,
    )
