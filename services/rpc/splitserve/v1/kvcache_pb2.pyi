from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("replica_id", "block_size", "num_blocks", "num_used_blocks", "num_free_blocks", "num_cached_blocks", "num_queries", "num_hits", "hit_rate", "num_requests", "num_store_hits")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERIES_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_HITS_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    block_size: int
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_queries: int
    num_hits: int
    hit_rate: float
    num_requests: int
    num_store_hits: int
    def __init__(self, replica_id: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_queries: _Optional[int] = ..., num_hits: _Optional[int] = ..., hit_rate: _Optional[float] = ..., num_requests: _Optional[int] = ..., num_store_hits: _Optional[int] = ...) -> None: ...

class StoreTierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "num_chunks", "num_bytes", "num_evicted_chunks", "num_dropped_chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    num_chunks: int
    num_bytes: int
    num_evicted_chunks: int
    num_dropped_chunks: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_evicted_chunks: _Optional[int] = ..., num_dropped_chunks: _Optional[int] = ...) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("chunk_tokens", "num_hit_tokens", "num_miss_tokens", "num_stored_chunks", "num_stored_tokens", "num_stored_bytes", "num_skipped_tokens", "num_loaded_chunks", "num_loaded_tokens", "num_loaded_bytes", "num_load_miss_tokens", "tiers")
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOAD_MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    chunk_tokens: int
    num_hit_tokens: int
    num_miss_tokens: int
    num_stored_chunks: int
    num_stored_tokens: int
    num_stored_bytes: int
    num_skipped_tokens: int
    num_loaded_chunks: int
    num_loaded_tokens: int
    num_loaded_bytes: int
    num_load_miss_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[StoreTierStats]
    def __init__(self, chunk_tokens: _Optional[int] = ..., num_hit_tokens: _Optional[int] = ..., num_miss_tokens: _Optional[int] = ..., num_stored_chunks: _Optional[int] = ..., num_stored_tokens: _Optional[int] = ..., num_stored_bytes: _Optional[int] = ..., num_skipped_tokens: _Optional[int] = ..., num_loaded_chunks: _Optional[int] = ..., num_loaded_tokens: _Optional[int] = ..., num_loaded_bytes: _Optional[int] = ..., num_load_miss_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[StoreTierStats, _Mapping]]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pools", "num_plans", "store")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    num_plans: int
    store: StoreStats
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., num_plans: _Optional[int] = ..., store: _Optional[_Union[StoreStats, _Mapping]] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    def __init__(self, replica_id: _Optional[int] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("num_cleared",)
    NUM_CLEARED_FIELD_NUMBER: _ClassVar[int]
    num_cleared: int
    def __init__(self, num_cleared: _Optional[int] = ...) -> None: ...
