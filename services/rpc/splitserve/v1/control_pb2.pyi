from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "device", "memory_bytes", "step_address", "model", "preferred_dtype", "cpu_level", "device_uuid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CPU_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    device: str
    memory_bytes: int
    step_address: str
    model: str
    preferred_dtype: str
    cpu_level: str
    device_uuid: str
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., step_address: _Optional[str] = ..., model: _Optional[str] = ..., preferred_dtype: _Optional[str] = ..., cpu_level: _Optional[str] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("replica_id", "pp_rank", "tp_rank", "pp_size", "tp_size", "first_layer", "end_layer", "block_size", "output_address", "dtype", "dist_init_method", "max_num_batched_tokens", "max_num_seqs", "kv_cache_dtype", "quantization")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIST_INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    pp_rank: int
    tp_rank: int
    pp_size: int
    tp_size: int
    first_layer: int
    end_layer: int
    block_size: int
    output_address: str
    dtype: str
    dist_init_method: str
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_cache_dtype: str
    quantization: str
    def __init__(self, replica_id: _Optional[int] = ..., pp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., first_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., block_size: _Optional[int] = ..., output_address: _Optional[str] = ..., dtype: _Optional[str] = ..., dist_init_method: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ...) -> None: ...

class CapacityReport(_message.Message):
    __slots__ = ("worker_id", "epoch", "num_kv_blocks", "kv_bytes_per_block", "kv_store_slice")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_SLICE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    num_kv_blocks: int
    kv_bytes_per_block: int
    kv_store_slice: KvSlice
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., kv_store_slice: _Optional[_Union[KvSlice, _Mapping]] = ...) -> None: ...

class KvSlice(_message.Message):
    __slots__ = ("model", "dtype", "layer_start", "layer_end", "head_start", "head_end")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    layer_start: int
    layer_end: int
    head_start: int
    head_end: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ...) -> None: ...

class CapacityAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "num_kv_chunks_stored", "num_kv_saves_skipped")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_CHUNKS_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_SAVES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    num_kv_chunks_stored: int
    num_kv_saves_skipped: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_kv_chunks_stored: _Optional[int] = ..., num_kv_saves_skipped: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
