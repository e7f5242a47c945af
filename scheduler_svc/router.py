"""Routing: where each live request runs.

A request is dispatched to a ready replica by a score blending the prefix kvcache_svc holds
for it there (in the replica's blocks, or in the KV store for its ranks) with the replica's
load (`route`). With no ready replica it stays parked (in
`LiveRequests`) and is dispatched when membership says one is ready, or ends (UNAVAILABLE)
at its deadline. When a replica goes down, membership hands its live requests here and they
are dispatched again (migration), their streams uninterrupted.

Membership owns the replicas; the router only reads which are ready and hears about changes
as membership's `ReplicaListener`. A thread of its own expires parked requests and retries
them every half second.

The prefix query is a call to kvcache_svc (up to ROUTE_QUERY_TIMEOUT_MS), and `dispatch` is
called on the gRPC event loop that streams every client's tokens: a dispatch that needs the
query hands it to the router's query thread and returns at once, so a slow kvcache_svc delays
only the requests being routed, never other clients' tokens. After a query times out, routing
goes by load alone for QUERY_BACKOFF_S (a kvcache_svc that is down or swamped is not asked
once per request).
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import zmq

from scheduler_svc.engine import ReplicaEngine
from scheduler_svc.live_requests import LiveRequests
from scheduler_svc.membership import Membership
from scheduler_svc.placement import Replica
from scheduler_svc.request import Request
from services.channels import RequestClient
from services.codec import Codec
from services.kv_wire import (
    FromKvCache,
    PrefixQuery,
    PrefixReply,
)

log = logging.getLogger(__name__)

TICK_S = 0.5
ROUTE_QUERY_TIMEOUT_MS = 100  # the prefix query is on the request path: never wait long
QUERY_BACKOFF_S = 1.0         # after a query timed out, route by load alone this long


class Router:
    def __init__(self, membership: Membership, live: LiveRequests, ctx: zmq.Context) -> None:
        self.membership = membership
        self.live = live
        self.num_migrations = 0
        self._lock = threading.Lock()   # the prefix-query socket and the counter
        self._route_kv: RequestClient[FromKvCache] = RequestClient(
            ctx, Codec(FromKvCache), membership.config.kvcache_address)
        self._query_backoff_until = 0.0     # monotonic; guarded by _lock
        # One thread: queries share one socket (and would only queue on the lock anyway).
        self._queries = ThreadPoolExecutor(max_workers=1, thread_name_prefix="route-query")
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="router", daemon=True)

    def start(self) -> None:
        self._ticker.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join(timeout=5)
        self._queries.shutdown(wait=True, cancel_futures=True)
        self._route_kv.close()

    # ------------------------------------------------------------------ placing requests

    def dispatch(self, request: Request) -> None:
        """Run a live request (added to `live`, parked) on the best ready replica, or leave it
        parked until one is ready. Never waits on kvcache_svc: a dispatch that needs the
        prefix query runs on the query thread (the request stays parked until then)."""
        if self._needs_query(request):
            try:
                self._queries.submit(self._dispatch_logged, request)
                return
            except RuntimeError:    # shut down: route here, by load
                pass
        self._dispatch_now(request)

    def _dispatch_logged(self, request: Request) -> None:
        try:
            self._dispatch_now(request)
        except Exception:   # it stays parked; the ticker retries it
            log.exception("routing request %s failed", request.request_id)

    def _needs_query(self, request: Request) -> bool:
        return (bool(request.block_hashes) and self.membership.kv_reachable
                and len(self.membership.ready_replicas()) > 1
                and time.monotonic() >= self._query_backoff_until)

    def _dispatch_now(self, request: Request) -> None:
        while True:
            engine = self.route(request)
            if engine is None or not self.live.place(request.request_id, engine):
                return   # stays parked; or it is gone, or another thread placed it
            if engine.submit(request):
                return
            # That replica went down between routing and submitting: park, route again.
            if not self.live.unplace(request.request_id, engine):
                return

    def route(self, request: Request) -> ReplicaEngine | None:
        """The ready replica with the best score = cached prefix tokens there -
        `route_tokens_per_request` x its live requests. Every live request counts as that
        many tokens of work, so a prompt goes where its prefix is cached unless that replica
        is busier by more than (cached tokens / route_tokens_per_request) requests; with no
        cache anywhere it goes to the least loaded."""
        ready = self.membership.ready_replicas()
        if not ready:
            return None
        cached: dict[int, int] = {}
        if len(ready) > 1 and request.block_hashes and self.membership.kv_reachable \
                and time.monotonic() >= self._query_backoff_until:
            cached = self._cached_blocks(request.block_hashes)
        block_size = self.membership.sched_config.block_size
        weight = self.membership.config.route_tokens_per_request

        def score(r: Replica) -> tuple[float, int]:
            hit = min(cached.get(r.replica_id, 0) * block_size, request.num_tokens - 1)
            return (hit - weight * self.live.num_on(r.replica_id), -r.replica_id)

        return max(ready, key=score).engine

    def _cached_blocks(self, block_hashes: list[bytes]) -> dict[int, int]:
        with self._lock:
            reply = self._route_kv.call(PrefixQuery(block_hashes=block_hashes),
                                        timeout_ms=ROUTE_QUERY_TIMEOUT_MS)
            if reply is None:
                self._query_backoff_until = time.monotonic() + QUERY_BACKOFF_S
        if not isinstance(reply, PrefixReply):
            return {}
        # What the KV store holds is reachable from every replica of the same layout (a load):
        # it counts as cached there too, so it never pulls a prompt to one replica.
        return {r.replica_id: max(r.num_cached_blocks, r.num_stored_blocks)
                for r in reply.replicas}

    def dispatch_parked(self) -> None:
        if not self.live.num_parked or not self.membership.ready_replicas():
            return
        for request in self.live.parked():
            self.dispatch(request)

    # ------------------------------------------------------------------ ReplicaListener

    def replica_ready(self) -> None:
        self.dispatch_parked()

    def replica_down(self, engine: ReplicaEngine, orphans: list[Request]) -> None:
        """Called from the stopped engine's thread: its live requests move on."""
        for request in orphans:
            if not self.live.unplace(request.request_id, engine):
                continue   # the client went away (or cancelled) meanwhile
            with self._lock:
                self.num_migrations += 1
            log.info("request %s (%d tokens out) moves off replica %d", request.request_id,
                     request.num_output_tokens, engine.replica_id)
            self.dispatch(request)

    # ------------------------------------------------------------------ ticker

    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.live.expire_parked(time.monotonic())
                self.dispatch_parked()
            except Exception:  # never let the ticker die
                log.exception("router pass failed")
