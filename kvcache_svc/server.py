"""kvcache_svc's edges: the plan loop (ZMQ ROUTER), the admin API (gRPC), the KV events (PUB).

`KvCachePools` holds every replica's `ReplicaBlockManager` behind one lock and turns each
`ToKvCache` message (plan, configure, drop, prefix query) into its reply; it needs no network.
It also owns the instance epoch, stamped on every reply so the scheduler notices a restart,
and turns each operation's prefix-index changes into one `KvEventBatch` for a publish callback.
`PlanLoop` answers plan-channel calls on a thread of its own; `KvCacheAdminServicer` converts
Stats/Clear between proto and core types; `KvCacheServer` binds the three sockets (four with
the KV store's, `kv_store.server`) and owns their lifetimes. Started by `kvcache_svc.__main__`.
"""

import logging
import threading
import time
from collections.abc import Callable

import grpc
import zmq

from kvcache_svc.block_manager import PoolStats, ReplicaBlockManager
from kvcache_svc.events import EventPublisher
from kvcache_svc.kv_store.config import KvStoreConfig, build_store
from kvcache_svc.kv_store.server import KvStoreLoop
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.view import StoreView
from services.channels import ReplyServer, tcp_address
from services.codec import Codec
from services.grpc_server import Health, bind, make_server
from services.kv_store_wire import store_stats_to_pb
from services.rpc.splitserve.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.wire import (
    MAX_REPLICAS,
    AllBlocksCleared,
    ConfigurePool,
    DropPool,
    FromKvCache,
    KvAck,
    KvEvent,
    KvEventBatch,
    PlanReply,
    PlanRequest,
    PrefixQuery,
    PrefixReply,
    ReplicaPrefix,
    ToKvCache,
    future_epoch,
)

log = logging.getLogger(__name__)

ADMIN_SERVICE_NAME = "splitserve.v1.KvCacheAdmin"
MAX_ERROR_LEN = 4096  # wire limit of PlanReply.error and KvAck.error
POLL_MS = 100         # how often the plan loop looks for a stop request


class KvCachePools:
    """Every replica's block manager, and the dispatch of plan-channel messages to them.

    One lock covers all pools: the plan loop and admin RPCs run on different threads. Event
    batches are handed to `publish` under that lock, so they leave in operation order.
    """

    def __init__(self, epoch: int | None = None,
                 publish: Callable[[KvEventBatch], None] | None = None) -> None:
        """`epoch` defaults to now (ns since the Unix epoch); `publish`, when given, receives
        one batch per operation that changed a prefix index, and must not raise."""
        self.epoch = time.time_ns() if epoch is None else epoch
        if not 0 <= self.epoch < 1 << 63:
            raise ValueError(f"epoch must be in [0, 2**63), got {self.epoch}")
        self._publish = publish
        self._seq = 0                       # of the next batch published
        self._lock = threading.Lock()
        self._managers: dict[int, ReplicaBlockManager] = {}
        self.scheduler_epoch = 0   # the scheduler instance that owns the pools
        self.num_plans = 0
        # The KV store (set by KvCacheServer once built): admissions of a pool configured with
        # its ranks' slices load what it holds past their prefix hit.
        self.store: KvStore | None = None

    def handle(self, message: ToKvCache) -> FromKvCache:
        """The reply to one message. Never raises: a failure becomes an error reply (a
        PlanReply for a plan, a KvAck for anything else)."""
        try:
            with self._lock:
                if isinstance(message, PlanRequest):
                    return self._plan(message)
                if isinstance(message, ConfigurePool):
                    return self._configure(message)
                if isinstance(message, DropPool):
                    return self._drop(message)
                return self._query(message)
        except Exception as exc:
            log.exception("failed to handle %s", type(message).__name__)
            error = f"internal error: {type(exc).__name__}: {exc}"[:MAX_ERROR_LEN]
            if isinstance(message, PlanRequest):
                return PlanReply(message.plan_id, [], [], 0, error, self.epoch)
            return KvAck(error, self.epoch)

    def _plan(self, plan: PlanRequest) -> PlanReply:
        self.num_plans += 1
        manager = self._managers.get(plan.replica_id)
        if manager is None:
            return PlanReply(plan.plan_id, [], [], 0,
                             f"unknown replica {plan.replica_id}: its pool is not configured "
                             f"(or was dropped)", self.epoch)
        try:
            reply = manager.apply(plan)
        finally:
            # A plan that failed half way may still have changed the index: report it all.
            self._publish_events(plan.replica_id, manager.drain_events())
        if reply.error is not None:
            log.warning("refused plan %d of replica %d: %s",
                        plan.plan_id, plan.replica_id, reply.error)
        return reply

    def _configure(self, message: ConfigurePool) -> KvAck:
        if (problem := future_epoch(message.scheduler_epoch)) is not None:
            return KvAck(f"scheduler {problem}", self.epoch)
        if message.scheduler_epoch < self.scheduler_epoch:
            return KvAck(f"scheduler epoch {message.scheduler_epoch} is older than "
                         f"{self.scheduler_epoch}: a newer scheduler owns the pools",
                         self.epoch)
        if message.scheduler_epoch > self.scheduler_epoch:
            if self._managers:
                log.warning("a new scheduler (epoch %d) took over: dropping the %d pools of "
                            "the previous one", message.scheduler_epoch, len(self._managers))
            for replica_id in sorted(self._managers):
                del self._managers[replica_id]
                self._publish_events(replica_id, [AllBlocksCleared()])
            self.scheduler_epoch = message.scheduler_epoch
        if message.replica_id not in self._managers and len(self._managers) >= MAX_REPLICAS:
            return KvAck(f"cannot configure replica {message.replica_id}: already "
                         f"{MAX_REPLICAS} pools", self.epoch)
        save_chunk_tokens = self._save_chunk_tokens(message)
        try:
            manager = ReplicaBlockManager(message.num_blocks, message.block_size,
                                          message.enable_prefix_caching, epoch=self.epoch,
                                          record_events=self._publish is not None,
                                          store=self._store_view(message),
                                          group_windows=message.group_windows,
                                          save_chunk_tokens=save_chunk_tokens)
        except ValueError as exc:
            return KvAck(str(exc)[:MAX_ERROR_LEN], self.epoch)
        # A restarted scheduler re-uses replica ids from 0: the old pool and its index go.
        replaced = self._managers.get(message.replica_id) is not None
        self._managers[message.replica_id] = manager
        if replaced:
            self._publish_events(message.replica_id, [AllBlocksCleared()])
        log.info("%s pool of replica %d: %d blocks of %d tokens, KV group windows %s, prefix "
                 "caching %s, loads from the KV store %s%s",
                 "re-created" if replaced else "created", message.replica_id,
                 message.num_blocks, message.block_size, list(message.group_windows),
                 "on" if message.enable_prefix_caching else "off",
                 "on" if manager.store is not None else "off",
                 f"; sliding groups keep the store chunk in progress ({save_chunk_tokens} "
                 f"tokens)" if save_chunk_tokens else "")
        return KvAck(None, self.epoch, save_chunk_tokens)

    def _save_chunk_tokens(self, message: ConfigurePool) -> int:
        """The chunk size the replica's workers save KV in, when they save (this process runs
        the store, in whole blocks) and a sliding group must keep a chunk's blocks until it
        is complete; else 0. Workers that are not told of a store save nothing, so holding
        for them costs at most one chunk per request and is never wrong."""
        if self.store is None or not any(message.group_windows):   # no sliding group
            return 0
        if self.store.chunk_tokens % message.block_size:
            return 0
        return self.store.chunk_tokens

    def _store_view(self, message: ConfigurePool) -> StoreView | None:
        if self.store is None or not message.store_slices:
            return None
        try:
            return StoreView(self.store, message.store_slices, message.block_size)
        except ValueError as exc:
            log.warning("replica %d will not load from the KV store: %s", message.replica_id,
                        exc)
            return None

    def _drop(self, message: DropPool) -> KvAck:
        if self._managers.pop(message.replica_id, None) is not None:
            log.info("dropped pool of replica %d", message.replica_id)
            self._publish_events(message.replica_id, [AllBlocksCleared()])
        return KvAck(None, self.epoch)

    def _query(self, query: PrefixQuery) -> PrefixReply:
        """Read-only: O(len(block_hashes)) dict lookups per pool, at most."""
        return PrefixReply(self.epoch, [
            ReplicaPrefix(replica_id, manager.num_cached_prefix_blocks(query.block_hashes),
                          manager.num_stored_prefix_blocks(query.block_hashes))
            for replica_id, manager in sorted(self._managers.items())],
            None if self.store is None else self.store.stats())

    def _publish_events(self, replica_id: int, events: list[KvEvent]) -> None:
        if not events or self._publish is None:
            return
        batch = KvEventBatch(self.epoch, self._seq, replica_id, events)
        self._seq += 1
        self._publish(batch)

    def stats(self) -> tuple[dict[int, PoolStats], int]:
        """Per replica stats, and the number of plan calls served."""
        with self._lock:
            pools = {replica_id: manager.stats()
                     for replica_id, manager in sorted(self._managers.items())}
            return pools, self.num_plans

    def clear(self, replica_id: int | None) -> int | None:
        """Drops cached unreferenced blocks of one replica (or every one); the count dropped,
        or None when `replica_id` names no pool."""
        with self._lock:
            if replica_id is None:
                return sum(self._clear(each_id, manager)
                           for each_id, manager in sorted(self._managers.items()))
            manager = self._managers.get(replica_id)
            return None if manager is None else self._clear(replica_id, manager)

    def _clear(self, replica_id: int, manager: ReplicaBlockManager) -> int:
        num_cleared = manager.clear()
        events = manager.drain_events()
        # Blocks in use keep their hashes: only an index left empty is "all cleared".
        if num_cleared and manager.pool.num_cached_blocks == 0:
            events = [AllBlocksCleared()]
        self._publish_events(replica_id, events)
        return num_cleared


class PlanLoop:
    """Answers plan-channel requests on its own thread until stopped.

    The socket is bound by the constructor (so a taken port fails there, on the caller's
    thread) and used only by the loop thread afterwards.
    """

    def __init__(self, ctx: zmq.Context, pools: KvCachePools, address: str,
                 on_fatal: Callable[[], None]) -> None:
        self.pools = pools
        self.address = address
        self.failed = False
        self._on_fatal = on_fatal
        self._server: ReplyServer[ToKvCache] = ReplyServer(ctx, Codec(ToKvCache), address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-plan-loop")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops the loop (or, if it never started, just closes the socket)."""
        self._stop.set()
        if self._thread.ident is None:
            self._server.close()
        else:
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                received = self._server.recv(timeout_ms=POLL_MS)
                if received is not None:
                    peer, message = received
                    self._server.reply(peer, self.pools.handle(message))
        except Exception:
            # Socket-level failures only (handle never raises): the service cannot go on.
            log.exception("plan loop failed")
            self.failed = True
            self._on_fatal()
        finally:
            self._server.close()


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


class KvCacheServer:
    """Binds the plan socket, the events socket and the admin server; starts and stops them."""

    def __init__(self, host: str, plan_port: int, admin_port: int, events_port: int,
                 on_fatal: Callable[[], None], cluster_token: str | None = None,
                 store_config: KvStoreConfig | None = None) -> None:
        """`cluster_token`: what admin calls must carry (services.cluster_token; None: none,
        for tests that drive the server alone). ZMQ frames follow the process's installed
        frame key. `store_config`: the KV store's (None: no store)."""
        self.host = host
        self.cluster_token = cluster_token
        self.plan_port = plan_port
        self.admin_port = admin_port
        self.events_port = events_port      # 0 until start() picks one, when asked for 0
        self.pools = KvCachePools(publish=self._publish)
        self._on_fatal = on_fatal
        self._ctx: zmq.Context | None = None
        self._plan_loop: PlanLoop | None = None
        self._events: EventPublisher | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: Health | None = None
        self.store_config = store_config
        self.store: KvStore | None = None
        self._store_loop: KvStoreLoop | None = None

    @property
    def plan_address(self) -> str:
        return tcp_address(self.host, self.plan_port)

    @property
    def events_address(self) -> str:
        return tcp_address(self.host, self.events_port)

    @property
    def store_address(self) -> str | None:
        return None if self._store_loop is None else self._store_loop.address

    @property
    def failed(self) -> bool:
        return any(loop is not None and loop.failed
                   for loop in (self._plan_loop, self._store_loop))

    def _publish(self, batch: KvEventBatch) -> None:
        # Nothing can change a pool before start() binds the socket (no message is served
        # yet); after stop() the closed publisher drops what a late call sends.
        if self._events is not None:
            self._events.publish(batch)

    async def start(self) -> None:
        """Binds and starts serving; raises OSError (having released everything) when a port
        cannot be bound."""
        ctx = zmq.Context()
        try:
            plan_loop = PlanLoop(ctx, self.pools, self.plan_address, self._on_fatal)
        except zmq.ZMQError as exc:
            # ReplyServer leaves its socket open when bind fails: destroy closes it.
            ctx.destroy(linger=0)
            raise OSError(f"cannot bind plan socket {self.plan_address}: {exc}") from exc
        try:
            events = EventPublisher(ctx, self.host, self.events_port)
        except zmq.ZMQError as exc:
            plan_loop.stop()
            ctx.destroy(linger=0)
            raise OSError(f"cannot bind events socket {self.events_address}: {exc}") from exc
        self.events_port = events.port
        try:
            self._start_store(ctx)
        except OSError:
            plan_loop.stop()
            events.close()
            ctx.destroy(linger=0)
            raise

        server = make_server(cluster_token=self.cluster_token)
        kvcache_pb2_grpc.add_KvCacheAdminServicer_to_server(
            KvCacheAdminServicer(self.pools, self.store), server)
        health = Health(server, [ADMIN_SERVICE_NAME])
        try:
            self.admin_port = bind(server, self.host, self.admin_port)
        except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError for a taken port
            plan_loop.stop()
            events.close()
            self._stop_store()
            ctx.term()
            raise OSError(f"cannot bind admin port {self.host}:{self.admin_port}: "
                          f"{exc}") from exc
        self._ctx, self._plan_loop, self._grpc, self._health = ctx, plan_loop, server, health
        self._events = events
        await self._grpc.start()
        await self._health.set_live()
        self._plan_loop.start()
        if self._store_loop is not None:
            self._store_loop.start()
        await self._health.set_ready(True)

    def _start_store(self, ctx: zmq.Context) -> None:
        """Builds the store and binds its socket (not yet served); OSError, with nothing left
        open, when its directory or port cannot be had."""
        if self.store_config is None:
            return
        store = build_store(self.store_config)
        try:
            self._store_loop = KvStoreLoop(ctx, store, self.host, self.store_config.port,
                                           self._on_fatal)
        except zmq.ZMQError as exc:
            store.close()
            raise OSError(f"cannot bind KV store socket "
                          f"{tcp_address(self.host, self.store_config.port)}: {exc}") from exc
        self.store = self.pools.store = store

    def _stop_store(self) -> None:
        if self._store_loop is not None:
            self._store_loop.stop()
        if self.store is not None:
            self.store.close()

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._health is not None:
            await self._health.shutdown()
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._plan_loop is not None:
            self._plan_loop.stop()
        if self._events is not None:
            self._events.close()
        self._stop_store()
        if self._ctx is not None:
            self._ctx.term()
