from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "draft", "warp", "seed", "sync", "processing", "logprobs", "top_logprobs", "prompt_logprobs_count", "prompt_top_logprobs", "tokenizer_hash", "vocab_size", "coordinator_id", "coordinator_requests")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    WARP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    draft: _common_pb2.DraftBlock
    warp: _common_pb2.WarpParams
    seed: int
    sync: _common_pb2.PrefixSync
    processing: _common_pb2.LogitsParams
    logprobs: bool
    top_logprobs: int
    prompt_logprobs_count: int
    prompt_top_logprobs: int
    tokenizer_hash: str
    vocab_size: int
    coordinator_id: str
    coordinator_requests: int
    def __init__(self, session_id: _Optional[str] = ..., draft: _Optional[_Union[_common_pb2.DraftBlock, _Mapping]] = ..., warp: _Optional[_Union[_common_pb2.WarpParams, _Mapping]] = ..., seed: _Optional[int] = ..., sync: _Optional[_Union[_common_pb2.PrefixSync, _Mapping]] = ..., processing: _Optional[_Union[_common_pb2.LogitsParams, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs_count: _Optional[int] = ..., prompt_top_logprobs: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., coordinator_id: _Optional[str] = ..., coordinator_requests: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("cache_status", "num_accepted", "token_ids", "cache_len", "computed_tokens", "compute_ms", "logprobs", "prompt_logprobs", "constrained", "service_requests", "resync_from")
    CACHE_STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    SERVICE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FROM_FIELD_NUMBER: _ClassVar[int]
    cache_status: _common_pb2.CacheStatus
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_len: int
    computed_tokens: int
    compute_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    constrained: bool
    service_requests: int
    resync_from: int
    def __init__(self, cache_status: _Optional[_Union[_common_pb2.CacheStatus, str]] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_len: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., compute_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., constrained: _Optional[bool] = ..., service_requests: _Optional[int] = ..., resync_from: _Optional[int] = ...) -> None: ...

class TargetReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class TargetReleaseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...
