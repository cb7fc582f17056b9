from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_METHOD_UNSPECIFIED: _ClassVar[DraftMethod]
    DRAFT_METHOD_MODEL: _ClassVar[DraftMethod]
    DRAFT_METHOD_NGRAM: _ClassVar[DraftMethod]
    DRAFT_METHOD_HYBRID: _ClassVar[DraftMethod]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
DRAFT_METHOD_UNSPECIFIED: DraftMethod
DRAFT_METHOD_MODEL: DraftMethod
DRAFT_METHOD_NGRAM: DraftMethod
DRAFT_METHOD_HYBRID: DraftMethod
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class SpeculationParams(_message.Message):
    __slots__ = ("num_speculative_tokens", "disable", "fixed", "method", "draft_confidence", "draft_block_confidence")
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    FIXED_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BLOCK_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    num_speculative_tokens: int
    disable: bool
    fixed: bool
    method: DraftMethod
    draft_confidence: float
    draft_block_confidence: float
    def __init__(self, num_speculative_tokens: _Optional[int] = ..., disable: _Optional[bool] = ..., fixed: _Optional[bool] = ..., method: _Optional[_Union[DraftMethod, str]] = ..., draft_confidence: _Optional[float] = ..., draft_block_confidence: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "prompt_token_ids", "sampling", "speculation", "require_existing_session", "messages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_EXISTING_SESSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: str
    prompt_token_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    speculation: SpeculationParams
    require_existing_session: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., require_existing_session: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("rounds", "draft_tokens_proposed", "draft_tokens_accepted", "target_forward_passes", "acceptance_rate", "mean_accepted_length", "target_only_rounds", "cache_resyncs", "pipelined_rounds", "draft_ms", "verify_ms", "overhead_ms", "mean_k", "lookup_rounds", "lookup_tokens_proposed", "lookup_tokens_accepted", "proposed_by_position", "accepted_by_position", "reply_lookup_rounds", "reply_lookup_tokens_accepted", "draft_catch_up_rounds", "first_round", "mean_block_stop")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_RESYNCS_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_K_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    REPLY_LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    REPLY_LOOKUP_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CATCH_UP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROUND_FIELD_NUMBER: _ClassVar[int]
    MEAN_BLOCK_STOP_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    target_forward_passes: int
    acceptance_rate: float
    mean_accepted_length: float
    target_only_rounds: int
    cache_resyncs: int
    pipelined_rounds: int
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    mean_k: float
    lookup_rounds: int
    lookup_tokens_proposed: int
    lookup_tokens_accepted: int
    proposed_by_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    reply_lookup_rounds: int
    reply_lookup_tokens_accepted: int
    draft_catch_up_rounds: int
    first_round: FirstRound
    mean_block_stop: float
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., target_forward_passes: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., target_only_rounds: _Optional[int] = ..., cache_resyncs: _Optional[int] = ..., pipelined_rounds: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., overhead_ms: _Optional[float] = ..., mean_k: _Optional[float] = ..., lookup_rounds: _Optional[int] = ..., lookup_tokens_proposed: _Optional[int] = ..., lookup_tokens_accepted: _Optional[int] = ..., proposed_by_position: _Optional[_Iterable[int]] = ..., accepted_by_position: _Optional[_Iterable[int]] = ..., reply_lookup_rounds: _Optional[int] = ..., reply_lookup_tokens_accepted: _Optional[int] = ..., draft_catch_up_rounds: _Optional[int] = ..., first_round: _Optional[_Union[FirstRound, _Mapping]] = ..., mean_block_stop: _Optional[float] = ...) -> None: ...

class FirstRound(_message.Message):
    __slots__ = ("draft_ms", "verify_ms", "draft_tokens_proposed", "lookup_tokens_proposed")
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    draft_ms: float
    verify_ms: float
    draft_tokens_proposed: int
    lookup_tokens_proposed: int
    def __init__(self, draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., draft_tokens_proposed: _Optional[int] = ..., lookup_tokens_proposed: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("session_id", "token_ids", "text", "finish_reason", "usage", "stats", "seed", "stop_string", "stop_token_id", "logprobs", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    stats: SpeculationStats
    seed: int
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., seed: _Optional[int] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("session_id", "token_ids", "text", "finish_reason", "usage", "stats", "seed", "stop_string", "stop_token_id", "logprobs", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    stats: SpeculationStats
    seed: int
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., seed: _Optional[int] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("server_version", "target_model_id", "draft_model_id", "draft_methods", "max_context_len", "draft_max_context_len", "vocab_size", "eos_token_ids", "max_speculative_tokens", "default_speculative_tokens", "max_new_tokens", "default_max_new_tokens", "max_message_bytes", "max_concurrent_requests", "max_prompt_chars", "speculation_mode", "adaptive_k", "features", "greedy_temperature", "chat_template", "max_top_logprobs", "default_draft_method", "lookup_max_tokens", "draft_vocab_method", "draft_confidence", "draft_block_confidence", "reply_index_tokens", "speculation_max_requests", "max_requests_per_caller", "max_sessions_per_caller", "draft_block_confidence_from_costs", "max_session_tokens_per_caller")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_METHODS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_CHARS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MODE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_K_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    GREEDY_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BLOCK_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    REPLY_INDEX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_PER_CALLER_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_PER_CALLER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BLOCK_CONFIDENCE_FROM_COSTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_TOKENS_PER_CALLER_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    target_model_id: str
    draft_model_id: str
    draft_methods: _containers.RepeatedScalarFieldContainer[str]
    max_context_len: int
    draft_max_context_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_speculative_tokens: int
    default_speculative_tokens: int
    max_new_tokens: int
    default_max_new_tokens: int
    max_message_bytes: int
    max_concurrent_requests: int
    max_prompt_chars: int
    speculation_mode: str
    adaptive_k: bool
    features: _containers.RepeatedScalarFieldContainer[str]
    greedy_temperature: float
    chat_template: bool
    max_top_logprobs: int
    default_draft_method: str
    lookup_max_tokens: int
    draft_vocab_method: str
    draft_confidence: float
    draft_block_confidence: float
    reply_index_tokens: int
    speculation_max_requests: int
    max_requests_per_caller: int
    max_sessions_per_caller: int
    draft_block_confidence_from_costs: bool
    max_session_tokens_per_caller: int
    def __init__(self, server_version: _Optional[str] = ..., target_model_id: _Optional[str] = ..., draft_model_id: _Optional[str] = ..., draft_methods: _Optional[_Iterable[str]] = ..., max_context_len: _Optional[int] = ..., draft_max_context_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_speculative_tokens: _Optional[int] = ..., default_speculative_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., default_max_new_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., max_prompt_chars: _Optional[int] = ..., speculation_mode: _Optional[str] = ..., adaptive_k: _Optional[bool] = ..., features: _Optional[_Iterable[str]] = ..., greedy_temperature: _Optional[float] = ..., chat_template: _Optional[bool] = ..., max_top_logprobs: _Optional[int] = ..., default_draft_method: _Optional[str] = ..., lookup_max_tokens: _Optional[int] = ..., draft_vocab_method: _Optional[str] = ..., draft_confidence: _Optional[float] = ..., draft_block_confidence: _Optional[float] = ..., reply_index_tokens: _Optional[int] = ..., speculation_max_requests: _Optional[int] = ..., max_requests_per_caller: _Optional[int] = ..., max_sessions_per_caller: _Optional[int] = ..., draft_block_confidence_from_costs: _Optional[bool] = ..., max_session_tokens_per_caller: _Optional[int] = ...) -> None: ...
