from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposalKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSAL_KIND_UNSPECIFIED: _ClassVar[ProposalKind]
    PROPOSAL_KIND_ONE_HOT: _ClassVar[ProposalKind]
    PROPOSAL_KIND_SPARSE: _ClassVar[ProposalKind]
    PROPOSAL_KIND_DENSE: _ClassVar[ProposalKind]

class CacheStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_STATUS_UNSPECIFIED: _ClassVar[CacheStatus]
    CACHE_STATUS_OK: _ClassVar[CacheStatus]
    CACHE_STATUS_RESYNC_REQUIRED: _ClassVar[CacheStatus]

class VocabTranslation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VOCAB_TRANSLATION_UNSPECIFIED: _ClassVar[VocabTranslation]
    VOCAB_TRANSLATION_SHARED: _ClassVar[VocabTranslation]
    VOCAB_TRANSLATION_TLI: _ClassVar[VocabTranslation]
    VOCAB_TRANSLATION_SLEM: _ClassVar[VocabTranslation]
PROPOSAL_KIND_UNSPECIFIED: ProposalKind
PROPOSAL_KIND_ONE_HOT: ProposalKind
PROPOSAL_KIND_SPARSE: ProposalKind
PROPOSAL_KIND_DENSE: ProposalKind
CACHE_STATUS_UNSPECIFIED: CacheStatus
CACHE_STATUS_OK: CacheStatus
CACHE_STATUS_RESYNC_REQUIRED: CacheStatus
VOCAB_TRANSLATION_UNSPECIFIED: VocabTranslation
VOCAB_TRANSLATION_SHARED: VocabTranslation
VOCAB_TRANSLATION_TLI: VocabTranslation
VOCAB_TRANSLATION_SLEM: VocabTranslation

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "stop", "include_stop_str_in_output", "logprobs", "top_logprobs", "prompt_logprobs", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "structured_output", "skip_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: int
    min_tokens: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    skip_special_tokens: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class LogitsParams(_message.Message):
    __slots__ = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "reply_start", "min_tokens", "banned_until_min", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    REPLY_START_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BANNED_UNTIL_MIN_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    reply_start: int
    min_tokens: int
    banned_until_min: _containers.RepeatedScalarFieldContainer[int]
    grammar: str
    def __init__(self, repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., reply_start: _Optional[int] = ..., min_tokens: _Optional[int] = ..., banned_until_min: _Optional[_Iterable[int]] = ..., grammar: _Optional[str] = ...) -> None: ...

class WarpParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class TokenProposal(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("token_ids", "kind", "proposals")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kind: ProposalKind
    proposals: _containers.RepeatedCompositeFieldContainer[TokenProposal]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., kind: _Optional[_Union[ProposalKind, str]] = ..., proposals: _Optional[_Iterable[_Union[TokenProposal, _Mapping]]] = ...) -> None: ...

class PrefixSync(_message.Message):
    __slots__ = ("base_len", "prefix_hash", "tail_token_ids", "source_session_id", "prompt_len", "shared_len")
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    TAIL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SHARED_LEN_FIELD_NUMBER: _ClassVar[int]
    base_len: int
    prefix_hash: int
    tail_token_ids: _containers.RepeatedScalarFieldContainer[int]
    source_session_id: str
    prompt_len: int
    shared_len: int
    def __init__(self, base_len: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., tail_token_ids: _Optional[_Iterable[int]] = ..., source_session_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., shared_len: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_hash", "device", "dtype", "max_context_len", "eos_token_ids", "instance_id", "active_sessions", "prefill_tokens_total", "host", "batched_forwards", "batched_requests", "reused_tokens_total", "vocab_translation", "model_tokenizer_hash", "shared_vocab_tokens", "cache_idle_s", "max_draft_tokens", "prefill_ms_per_token", "prefill_ms_per_token_per_1k_context", "structured_output")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_TRANSLATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    SHARED_VOCAB_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_PER_1K_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_hash: str
    device: str
    dtype: str
    max_context_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    active_sessions: int
    prefill_tokens_total: int
    host: str
    batched_forwards: int
    batched_requests: int
    reused_tokens_total: int
    vocab_translation: VocabTranslation
    model_tokenizer_hash: str
    shared_vocab_tokens: int
    cache_idle_s: float
    max_draft_tokens: int
    prefill_ms_per_token: float
    prefill_ms_per_token_per_1k_context: float
    structured_output: bool
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_context_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., active_sessions: _Optional[int] = ..., prefill_tokens_total: _Optional[int] = ..., host: _Optional[str] = ..., batched_forwards: _Optional[int] = ..., batched_requests: _Optional[int] = ..., reused_tokens_total: _Optional[int] = ..., vocab_translation: _Optional[_Union[VocabTranslation, str]] = ..., model_tokenizer_hash: _Optional[str] = ..., shared_vocab_tokens: _Optional[int] = ..., cache_idle_s: _Optional[float] = ..., max_draft_tokens: _Optional[int] = ..., prefill_ms_per_token: _Optional[float] = ..., prefill_ms_per_token_per_1k_context: _Optional[float] = ..., structured_output: _Optional[bool] = ...) -> None: ...
