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
    __slots__ = ("replica_id", "block_size", "num_blocks", "num_used_blocks", "num_free_blocks", "num_cached_blocks", "num_queries", "num_hits", "hit_rate", "num_requests")
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
    def __init__(self, replica_id: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_queries: _Optional[int] = ..., num_hits: _Optional[int] = ..., hit_rate: _Optional[float] = ..., num_requests: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pools", "num_plans")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    num_plans: int
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., num_plans: _Optional[int] = ...) -> None: ...

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
