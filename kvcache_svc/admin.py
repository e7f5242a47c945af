"""kvcache_svc's admin API (gRPC KvCacheAdmin): Stats and Clear, converted between proto and
the pools' (and the KV store's) own types. Served by `server.KvCacheServer`.
"""


import grpc

from kvcache_svc.block_manager import PoolStats
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.pools import KvCachePools
from services.kv_store_wire import store_stats_to_pb
from services.rpc.splitserve.v1 import kvcache_pb2, kvcache_pb2_grpc

ADMIN_SERVICE_NAME = "splitserve.v1.KvCacheAdmin"


class KvCacheAdminServicer(kvcache_pb2_grpc.KvCacheAdminServicer):
    """gRPC KvCacheAdmin: converts proto to core calls and back, nothing more."""

    def __init__(self, pools: KvCachePools, store: KvStore | None = None) -> None:
        self.pools = pools
        self.store = self.pools.store = store

    async def Stats(self, request: kvcache_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> kvcache_pb2.StatsResponse:
        pools, num_plans = self.pools.stats()
        return kvcache_pb2.StatsResponse(
            pools=[_stats_to_pb(replica_id, stats) for replica_id, stats in pools.items()],
            num_plans=num_plans,
            store=None if self.store is None else store_stats_to_pb(self.store.stats()))

    async def Clear(self, request: kvcache_pb2.ClearRequest,
                    context: grpc.aio.ServicerContext) -> kvcache_pb2.ClearResponse:
        replica_id = request.replica_id if request.HasField("replica_id") else None
        num_cleared = self.pools.clear(replica_id)
        if num_cleared is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown replica {replica_id}")
        return kvcache_pb2.ClearResponse(num_cleared=num_cleared)


def _stats_to_pb(replica_id: int, stats: PoolStats) -> kvcache_pb2.PoolStats:
    return kvcache_pb2.PoolStats(
        replica_id=replica_id,
        block_size=stats.block_size,
        num_blocks=stats.num_blocks,
        num_used_blocks=stats.num_used_blocks,
        num_free_blocks=stats.num_free_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        num_queries=stats.num_queries,
        num_hits=stats.num_hits,
        num_store_hits=stats.num_store_hits,
        hit_rate=stats.hit_rate,
        num_requests=stats.num_requests,
    )
