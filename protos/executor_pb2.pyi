from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Protocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_UNSPECIFIED: _ClassVar[Protocol]
    PROTOCOL_VERSION: _ClassVar[Protocol]
PROTOCOL_UNSPECIFIED: Protocol
PROTOCOL_VERSION: Protocol

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_name", "fingerprint", "dtype", "block_size", "num_gpu_blocks", "num_cpu_blocks", "max_model_len", "vocab_size", "tokenizer", "backend", "instance_id", "protocol_version", "generation_config", "step_limits", "quantization", "kv_cache_dtype")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_CONFIG_FIELD_NUMBER: _ClassVar[int]
    STEP_LIMITS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    fingerprint: str
    dtype: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    vocab_size: int
    tokenizer: str
    backend: str
    instance_id: int
    protocol_version: int
    generation_config: GenerationConfig
    step_limits: StepLimits
    quantization: str
    kv_cache_dtype: str
    def __init__(self, model_name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer: _Optional[str] = ..., backend: _Optional[str] = ..., instance_id: _Optional[int] = ..., protocol_version: _Optional[int] = ..., generation_config: _Optional[_Union[GenerationConfig, _Mapping]] = ..., step_limits: _Optional[_Union[StepLimits, _Mapping]] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class StepLimits(_message.Message):
    __slots__ = ("max_num_batched_tokens", "max_num_seqs", "bounded", "source", "decode_graph_sizes", "small_step_graph_sizes")
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRAPH_SIZES_FIELD_NUMBER: _ClassVar[int]
    SMALL_STEP_GRAPH_SIZES_FIELD_NUMBER: _ClassVar[int]
    max_num_batched_tokens: int
    max_num_seqs: int
    bounded: bool
    source: str
    decode_graph_sizes: _containers.RepeatedScalarFieldContainer[int]
    small_step_graph_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., bounded: _Optional[bool] = ..., source: _Optional[str] = ..., decode_graph_sizes: _Optional[_Iterable[int]] = ..., small_step_graph_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationConfig(_message.Message):
    __slots__ = ("eos_token_ids", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_new_tokens: int
    def __init__(self, eos_token_ids: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias_token_ids", "logit_bias_values", "logprobs", "grammar")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    logprobs: int
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class NewSeq(_message.Message):
    __slots__ = ("seq_id", "token_ids", "block_table", "num_computed_tokens", "num_scheduled_tokens", "sampling", "num_prompt_tokens", "first_position")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingOptions
    num_prompt_tokens: int
    first_position: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_table: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., first_position: _Optional[int] = ...) -> None: ...

class CachedSeqs(_message.Message):
    __slots__ = ("seq_ids", "num_scheduled_tokens", "num_computed_tokens", "num_new_blocks", "new_block_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("scheduler_id", "epoch", "takeover", "protocol_version")
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    epoch: int
    takeover: bool
    protocol_version: int
    def __init__(self, scheduler_id: _Optional[str] = ..., epoch: _Optional[int] = ..., takeover: _Optional[bool] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "swap_out", "swap_in", "copy", "new_seqs", "finished_seq_ids", "preempted_seq_ids", "lease", "cached")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSeq]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    preempted_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    lease: Lease
    cached: CachedSeqs
    def __init__(self, step_id: _Optional[int] = ..., swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., new_seqs: _Optional[_Iterable[_Union[NewSeq, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., preempted_seq_ids: _Optional[_Iterable[int]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., cached: _Optional[_Union[CachedSeqs, _Mapping]] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("seq_ids", "token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SampledLogprobs(_message.Message):
    __slots__ = ("seq_ids", "logprobs", "num_top_logprobs", "top_token_ids", "top_logprobs")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top_logprobs: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top_logprobs: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "forward_ms", "step_ms", "sampled", "logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    forward_ms: float
    step_ms: float
    sampled: SampledTokens
    logprobs: SampledLogprobs
    def __init__(self, step_id: _Optional[int] = ..., forward_ms: _Optional[float] = ..., step_ms: _Optional[float] = ..., sampled: _Optional[_Union[SampledTokens, _Mapping]] = ..., logprobs: _Optional[_Union[SampledLogprobs, _Mapping]] = ...) -> None: ...
