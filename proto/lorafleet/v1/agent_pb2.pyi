from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterResidency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_RESIDENCY_UNSPECIFIED: _ClassVar[AdapterResidency]
    ADAPTER_RESIDENCY_RESIDENT: _ClassVar[AdapterResidency]
    ADAPTER_RESIDENCY_STANDBY: _ClassVar[AdapterResidency]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
ADAPTER_RESIDENCY_UNSPECIFIED: AdapterResidency
ADAPTER_RESIDENCY_RESIDENT: AdapterResidency
ADAPTER_RESIDENCY_STANDBY: AdapterResidency
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ProveIdentityRequest(_message.Message):
    __slots__ = ("nonce", "pod")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    pod: str
    def __init__(self, nonce: _Optional[bytes] = ..., pod: _Optional[str] = ...) -> None: ...

class ProveIdentityResponse(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("agent_id", "base_model", "topology", "capacity", "ranks", "modules", "has_tokenizer", "backend")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    base_model: BaseModel
    topology: Topology
    capacity: Capacity
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    modules: _containers.RepeatedCompositeFieldContainer[ModuleShapes]
    has_tokenizer: bool
    backend: BackendInfo
    def __init__(self, agent_id: _Optional[str] = ..., base_model: _Optional[_Union[BaseModel, _Mapping]] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., modules: _Optional[_Iterable[_Union[ModuleShapes, _Mapping]]] = ..., has_tokenizer: _Optional[bool] = ..., backend: _Optional[_Union[BackendInfo, _Mapping]] = ...) -> None: ...

class BackendInfo(_message.Message):
    __slots__ = ("kind", "version", "endpoints")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    version: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[str] = ..., version: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class BaseModel(_message.Message):
    __slots__ = ("name", "config_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_sha256: str
    def __init__(self, name: _Optional[str] = ..., config_sha256: _Optional[str] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("tp_size", "dp_size", "attn_tp_size", "fully_sharded_loras", "ep_size", "moe_tp_size")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTN_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    FULLY_SHARDED_LORAS_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MOE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    dp_size: int
    attn_tp_size: int
    fully_sharded_loras: bool
    ep_size: int
    moe_tp_size: int
    def __init__(self, tp_size: _Optional[int] = ..., dp_size: _Optional[int] = ..., attn_tp_size: _Optional[int] = ..., fully_sharded_loras: _Optional[bool] = ..., ep_size: _Optional[int] = ..., moe_tp_size: _Optional[int] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("max_lora_rank", "max_loras_per_batch", "max_loaded_loras")
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_LOADED_LORAS_FIELD_NUMBER: _ClassVar[int]
    max_lora_rank: int
    max_loras_per_batch: int
    max_loaded_loras: int
    def __init__(self, max_lora_rank: _Optional[int] = ..., max_loras_per_batch: _Optional[int] = ..., max_loaded_loras: _Optional[int] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "attn_dp_rank", "attn_tp_rank", "alive")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ATTN_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTN_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    alive: bool
    def __init__(self, rank: _Optional[int] = ..., attn_dp_rank: _Optional[int] = ..., attn_tp_rank: _Optional[int] = ..., alive: _Optional[bool] = ...) -> None: ...

class ModuleShapes(_message.Message):
    __slots__ = ("module", "rank", "slices")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    module: str
    rank: int
    slices: _containers.RepeatedCompositeFieldContainer[LoraSliceShape]
    def __init__(self, module: _Optional[str] = ..., rank: _Optional[int] = ..., slices: _Optional[_Iterable[_Union[LoraSliceShape, _Mapping]]] = ...) -> None: ...

class LoraSliceShape(_message.Message):
    __slots__ = ("lora_a_shape", "lora_b_shape")
    LORA_A_SHAPE_FIELD_NUMBER: _ClassVar[int]
    LORA_B_SHAPE_FIELD_NUMBER: _ClassVar[int]
    lora_a_shape: _containers.RepeatedScalarFieldContainer[int]
    lora_b_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lora_a_shape: _Optional[_Iterable[int]] = ..., lora_b_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "source_uri", "sha256", "pinned", "replace", "source_token", "source_basic", "standby", "source_s3", "source_revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BASIC_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_S3_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    source_uri: str
    sha256: str
    pinned: bool
    replace: bool
    source_token: str
    source_basic: SourceBasicAuth
    standby: bool
    source_s3: SourceS3Credential
    source_revision: str
    def __init__(self, name: _Optional[str] = ..., source_uri: _Optional[str] = ..., sha256: _Optional[str] = ..., pinned: _Optional[bool] = ..., replace: _Optional[bool] = ..., source_token: _Optional[str] = ..., source_basic: _Optional[_Union[SourceBasicAuth, _Mapping]] = ..., standby: _Optional[bool] = ..., source_s3: _Optional[_Union[SourceS3Credential, _Mapping]] = ..., source_revision: _Optional[str] = ...) -> None: ...

class ResolveSourceRequest(_message.Message):
    __slots__ = ("source_uri", "source_token", "source_basic", "source_s3")
    SOURCE_URI_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BASIC_FIELD_NUMBER: _ClassVar[int]
    SOURCE_S3_FIELD_NUMBER: _ClassVar[int]
    source_uri: str
    source_token: str
    source_basic: SourceBasicAuth
    source_s3: SourceS3Credential
    def __init__(self, source_uri: _Optional[str] = ..., source_token: _Optional[str] = ..., source_basic: _Optional[_Union[SourceBasicAuth, _Mapping]] = ..., source_s3: _Optional[_Union[SourceS3Credential, _Mapping]] = ...) -> None: ...

class ResolveSourceResponse(_message.Message):
    __slots__ = ("source_revision",)
    SOURCE_REVISION_FIELD_NUMBER: _ClassVar[int]
    source_revision: str
    def __init__(self, source_revision: _Optional[str] = ...) -> None: ...

class SourceBasicAuth(_message.Message):
    __slots__ = ("username", "password")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    username: str
    password: str
    def __init__(self, username: _Optional[str] = ..., password: _Optional[str] = ...) -> None: ...

class SourceS3Credential(_message.Message):
    __slots__ = ("access_key_id", "secret_access_key", "session_token")
    ACCESS_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_ACCESS_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    access_key_id: str
    secret_access_key: str
    session_token: str
    def __init__(self, access_key_id: _Optional[str] = ..., secret_access_key: _Optional[str] = ..., session_token: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("success", "error_message", "loaded_adapters", "rank_results", "already_loaded", "transient", "source_revision", "residency")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RANK_RESULTS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REVISION_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    success: bool
    error_message: str
    loaded_adapters: _containers.RepeatedScalarFieldContainer[str]
    rank_results: _containers.RepeatedCompositeFieldContainer[RankResult]
    already_loaded: bool
    transient: bool
    source_revision: str
    residency: AdapterResidency
    def __init__(self, success: _Optional[bool] = ..., error_message: _Optional[str] = ..., loaded_adapters: _Optional[_Iterable[str]] = ..., rank_results: _Optional[_Iterable[_Union[RankResult, _Mapping]]] = ..., already_loaded: _Optional[bool] = ..., transient: _Optional[bool] = ..., source_revision: _Optional[str] = ..., residency: _Optional[_Union[AdapterResidency, str]] = ...) -> None: ...

class LoadAdaptersRequest(_message.Message):
    __slots__ = ("loads",)
    LOADS_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[LoadAdapterRequest]
    def __init__(self, loads: _Optional[_Iterable[_Union[LoadAdapterRequest, _Mapping]]] = ...) -> None: ...

class LoadAdaptersResponse(_message.Message):
    __slots__ = ("outcomes", "loaded_adapters")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[LoadAdapterOutcome]
    loaded_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[LoadAdapterOutcome, _Mapping]]] = ..., loaded_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadAdapterOutcome(_message.Message):
    __slots__ = ("code", "error_message", "reason", "reply")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    code: int
    error_message: str
    reason: str
    reply: LoadAdapterResponse
    def __init__(self, code: _Optional[int] = ..., error_message: _Optional[str] = ..., reason: _Optional[str] = ..., reply: _Optional[_Union[LoadAdapterResponse, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("success", "error_message", "loaded_adapters", "rank_results", "transient")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RANK_RESULTS_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_FIELD_NUMBER: _ClassVar[int]
    success: bool
    error_message: str
    loaded_adapters: _containers.RepeatedScalarFieldContainer[str]
    rank_results: _containers.RepeatedCompositeFieldContainer[RankResult]
    transient: bool
    def __init__(self, success: _Optional[bool] = ..., error_message: _Optional[str] = ..., loaded_adapters: _Optional[_Iterable[str]] = ..., rank_results: _Optional[_Iterable[_Union[RankResult, _Mapping]]] = ..., transient: _Optional[bool] = ...) -> None: ...

class RankResult(_message.Message):
    __slots__ = ("rank", "attn_dp_rank", "attn_tp_rank", "success", "error_message", "weights_sha256", "config_sha256", "transient")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ATTN_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTN_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    success: bool
    error_message: str
    weights_sha256: str
    config_sha256: str
    transient: bool
    def __init__(self, rank: _Optional[int] = ..., attn_dp_rank: _Optional[int] = ..., attn_tp_rank: _Optional[int] = ..., success: _Optional[bool] = ..., error_message: _Optional[str] = ..., weights_sha256: _Optional[str] = ..., config_sha256: _Optional[str] = ..., transient: _Optional[bool] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "downloading")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADING_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    downloading: _containers.RepeatedCompositeFieldContainer[DownloadProgress]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., downloading: _Optional[_Iterable[_Union[DownloadProgress, _Mapping]]] = ...) -> None: ...

class DownloadProgress(_message.Message):
    __slots__ = ("name", "bytes_done", "bytes_total")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    bytes_done: int
    bytes_total: int
    def __init__(self, name: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "source_uri", "sha256", "pinned", "ranks", "residency")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    name: str
    source_uri: str
    sha256: str
    pinned: bool
    ranks: _containers.RepeatedScalarFieldContainer[int]
    residency: AdapterResidency
    def __init__(self, name: _Optional[str] = ..., source_uri: _Optional[str] = ..., sha256: _Optional[str] = ..., pinned: _Optional[bool] = ..., ranks: _Optional[_Iterable[int]] = ..., residency: _Optional[_Union[AdapterResidency, str]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("token_ids", "adapter")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[str] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("logits",)
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    logits: _containers.RepeatedCompositeFieldContainer[Logits]
    def __init__(self, logits: _Optional[_Iterable[_Union[Logits, _Mapping]]] = ...) -> None: ...

class Logits(_message.Message):
    __slots__ = ("num_tokens", "vocab_size", "float32_data")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    FLOAT32_DATA_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    vocab_size: int
    float32_data: bytes
    def __init__(self, num_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., float32_data: _Optional[bytes] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("token_ids", "prompt", "adapter", "max_new_tokens", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "stop")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    adapter: str
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., adapter: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_id", "text", "finish_reason", "finish", "logprob", "top_logprobs", "usage")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    finish_reason: str
    finish: FinishReason
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    usage: Usage
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., finish: _Optional[_Union[FinishReason, str]] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class AdapterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterStatsResponse(_message.Message):
    __slots__ = ("taken_at_unix_s", "window_s", "adapters")
    TAKEN_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    taken_at_unix_s: float
    window_s: float
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterStat]
    def __init__(self, taken_at_unix_s: _Optional[float] = ..., window_s: _Optional[float] = ..., adapters: _Optional[_Iterable[_Union[AdapterStat, _Mapping]]] = ...) -> None: ...

class AdapterStat(_message.Message):
    __slots__ = ("adapter", "running", "waiting", "generated_tokens", "tokens_per_s", "ttft_count", "ttft_mean_s", "ttft_p50_s")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_COUNT_FIELD_NUMBER: _ClassVar[int]
    TTFT_MEAN_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_S_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    running: int
    waiting: int
    generated_tokens: int
    tokens_per_s: float
    ttft_count: int
    ttft_mean_s: float
    ttft_p50_s: float
    def __init__(self, adapter: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., ttft_count: _Optional[int] = ..., ttft_mean_s: _Optional[float] = ..., ttft_p50_s: _Optional[float] = ...) -> None: ...
