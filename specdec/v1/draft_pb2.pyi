from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "round_id", "num_tokens", "warp", "seed", "lookahead", "adopt_lookahead", "vocab_limit", "sync", "processing", "min_confidence", "min_block_confidence", "tokenizer_hash", "report_stops_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    ADOPT_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    VOCAB_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    MIN_BLOCK_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    REPORT_STOPS_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round_id: int
    num_tokens: int
    warp: _common_pb2.WarpParams
    seed: int
    lookahead: bool
    adopt_lookahead: bool
    vocab_limit: int
    sync: _common_pb2.PrefixSync
    processing: _common_pb2.LogitsParams
    min_confidence: float
    min_block_confidence: float
    tokenizer_hash: str
    report_stops_only: bool
    def __init__(self, session_id: _Optional[str] = ..., round_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., warp: _Optional[_Union[_common_pb2.WarpParams, _Mapping]] = ..., seed: _Optional[int] = ..., lookahead: _Optional[bool] = ..., adopt_lookahead: _Optional[bool] = ..., vocab_limit: _Optional[int] = ..., sync: _Optional[_Union[_common_pb2.PrefixSync, _Mapping]] = ..., processing: _Optional[_Union[_common_pb2.LogitsParams, _Mapping]] = ..., min_confidence: _Optional[float] = ..., min_block_confidence: _Optional[float] = ..., tokenizer_hash: _Optional[str] = ..., report_stops_only: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("round_id", "cache_status", "draft", "cache_len", "compute_ms", "lookahead", "base_len", "assumed_token_ids", "ends_unsure", "resync_from", "unsure_at")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_STATUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDS_UNSURE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FROM_FIELD_NUMBER: _ClassVar[int]
    UNSURE_AT_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    cache_status: _common_pb2.CacheStatus
    draft: _common_pb2.DraftBlock
    cache_len: int
    compute_ms: float
    lookahead: bool
    base_len: int
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ends_unsure: bool
    resync_from: int
    unsure_at: int
    def __init__(self, round_id: _Optional[int] = ..., cache_status: _Optional[_Union[_common_pb2.CacheStatus, str]] = ..., draft: _Optional[_Union[_common_pb2.DraftBlock, _Mapping]] = ..., cache_len: _Optional[int] = ..., compute_ms: _Optional[float] = ..., lookahead: _Optional[bool] = ..., base_len: _Optional[int] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., ends_unsure: _Optional[bool] = ..., resync_from: _Optional[int] = ..., unsure_at: _Optional[int] = ...) -> None: ...

class DraftReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftReleaseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...
