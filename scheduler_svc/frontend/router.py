"""Routing: which ready replica a front end's request runs on.

A request goes to the ready replica (from the cluster's state) with the best score: the
prefix kvcache_svc holds for it there (in the replica's blocks, or in the KV store for its
ranks) blended with the load this front end has put there (`choose`). Front ends share the
clients evenly (the kernel spreads connections over them), so each balancing its own share
balances the whole.

The prefix query is a call to kvcache_svc (up to ROUTE_QUERY_TIMEOUT_MS) made on the router's
own thread (`cached_blocks`), so a slow kvcache_svc delays only the requests being routed,
never other clients' tokens. After a query times out, routing goes by load alone for
QUERY_BACKOFF_S (a kvcache_svc that is down or swamped is not asked once per request).
"""

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import zmq

from scheduler_svc.cluster.wire import ReplicaEntry
from scheduler_svc.frontend.requests import FrontRequest, Placement
from services.block_hash import NONE_HASH, hash_full_blocks
from services.channels import RequestClient
from services.codec import Codec
from services.kv_wire import FromKvCache, PrefixQuery, PrefixReply

ROUTE_QUERY_TIMEOUT_MS = 100  # the prefix query is on the request path: never wait long
QUERY_BACKOFF_S = 1.0         # after a query timed out, route by load alone this long


class Router:
    def __init__(self, ctx: zmq.Context, kvcache_address: str, block_size: int,
                 prefix_caching: bool, route_tokens_per_request: float) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.weight = route_tokens_per_request
        # One thread: queries share one socket, used on that thread only.
        self._queries = ThreadPoolExecutor(max_workers=1, thread_name_prefix="route-query")
        self._client: RequestClient[FromKvCache] = RequestClient(ctx, Codec(FromKvCache),
                                                                 kvcache_address)
        self._backoff_until = 0.0

    def close(self) -> None:
        self._queries.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def block_hashes(self, request: FrontRequest) -> list[bytes]:
        """Its prompt's full blocks' chained hashes, as the engine computes them."""
        if request.block_hashes is None:
            request.block_hashes = hash_full_blocks(
                request.token_ids, self.block_size, NONE_HASH,
                cache_salt=request.cache_salt) if self.prefix_caching else []
        return request.block_hashes

    def needs_query(self, request: FrontRequest, ready: list[ReplicaEntry],
                    kv_reachable: bool) -> bool:
        return (len(ready) > 1 and kv_reachable and time.monotonic() >= self._backoff_until
                and bool(self.block_hashes(request)))

    async def cached_blocks(self, block_hashes: list[bytes]) -> dict[int, int]:
        """Replica id -> leading blocks of `block_hashes` it can serve ({} on no answer)."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._queries, self._query, block_hashes)
        except RuntimeError:      # shut down: route by load
            return {}

    def _query(self, block_hashes: list[bytes]) -> dict[int, int]:
        reply = self._client.call(PrefixQuery(block_hashes=block_hashes),
                                  timeout_ms=ROUTE_QUERY_TIMEOUT_MS)
        if not isinstance(reply, PrefixReply):
            self._backoff_until = time.monotonic() + QUERY_BACKOFF_S
            return {}
        # What the KV store holds is reachable from every replica of the same layout (a load):
        # it counts as cached there too, so it never pulls a prompt to one replica.
        return {r.replica_id: max(r.num_cached_blocks, r.num_stored_blocks)
                for r in reply.replicas}

    def choose(self, request: FrontRequest, ready: list[ReplicaEntry], cached: dict[int, int],
               num_on: Callable[[Placement], int]) -> ReplicaEntry | None:
        """The ready replica with the best score = cached prefix tokens there -
        `route_tokens_per_request` x this front end's live requests there. Every live
        request counts as that many tokens of work, so a prompt goes where its prefix is
        cached unless that replica is busier by more than (cached tokens /
        route_tokens_per_request) requests; with no cache anywhere it goes to the least
        loaded."""
        if not ready:
            return None
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)

        def score(r: ReplicaEntry) -> tuple[float, int]:
            hit = min(cached.get(r.replica_id, 0) * self.block_size, num_tokens - 1)
            return (hit - self.weight * num_on((r.replica_id, r.engine_epoch)), -r.replica_id)

        return max(ready, key=score)
