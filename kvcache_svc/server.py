"""kvcache_svc's two edges: the per-step plan loop (ZMQ ROUTER) and the admin API (gRPC).

`KvCachePools` holds every replica's `ReplicaBlockManager` behind one lock and turns each
`ToKvCache` message into its reply; it needs no network. `PlanLoop` answers plan calls on a
thread of its own; `KvCacheAdminServicer` converts Stats/Clear between proto and core types;
`KvCacheServer` binds both and owns their lifetimes. Started by `kvcache_svc.__main__`.
"""

import logging
import threading
from collections.abc import Callable

import grpc
import zmq

from kvcache_svc.block_manager import PoolStats, ReplicaBlockManager
from services.channels import ReplyServer, tcp_address
from services.codec import Codec
from services.grpc_server import Health, bind, make_server
from services.rpc.splitserve.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.wire import (
    ConfigurePool,
    DropPool,
    FromKvCache,
    KvAck,
    PlanReply,
    PlanRequest,
    ToKvCache,
)

log = logging.getLogger(__name__)

ADMIN_SERVICE_NAME = "splitserve.v1.KvCacheAdmin"
MAX_ERROR_LEN = 4096  # wire limit of PlanReply.error and KvAck.error
POLL_MS = 100         # how often the plan loop looks for a stop request


class KvCachePools:
    """Every replica's block manager, and the dispatch of plan-channel messages to them.

    One lock covers all pools: the plan loop and admin RPCs run on different threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._managers: dict[int, ReplicaBlockManager] = {}
        self.num_plans = 0

    def handle(self, message: ToKvCache) -> FromKvCache:
        """The reply to one message. Never raises: a failure becomes an error reply."""
        try:
            with self._lock:
                if isinstance(message, PlanRequest):
                    return self._plan(message)
                if isinstance(message, ConfigurePool):
                    return self._configure(message)
                return self._drop(message)
        except Exception as exc:
            log.exception("failed to handle %s", type(message).__name__)
            error = f"internal error: {type(exc).__name__}: {exc}"[:MAX_ERROR_LEN]
            if isinstance(message, PlanRequest):
                return PlanReply(message.plan_id, [], [], 0, error)
            return KvAck(error)

    def _plan(self, plan: PlanRequest) -> PlanReply:
        self.num_plans += 1
        manager = self._managers.get(plan.replica_id)
        if manager is None:
            return PlanReply(plan.plan_id, [], [], 0, f"unknown replica {plan.replica_id}")
        reply = manager.apply(plan)
        if reply.error is not None:
            log.warning("refused plan %d of replica %d: %s",
                        plan.plan_id, plan.replica_id, reply.error)
        return reply

    def _configure(self, message: ConfigurePool) -> KvAck:
        try:
            manager = ReplicaBlockManager(message.num_blocks, message.block_size,
                                          message.enable_prefix_caching)
        except ValueError as exc:
            return KvAck(str(exc)[:MAX_ERROR_LEN])
        replaced = self._managers.get(message.replica_id) is not None
        self._managers[message.replica_id] = manager
        log.info("%s pool of replica %d: %d blocks of %d tokens, prefix caching %s",
                 "re-created" if replaced else "created", message.replica_id,
                 message.num_blocks, message.block_size,
                 "on" if message.enable_prefix_caching else "off")
        return KvAck(None)

    def _drop(self, message: DropPool) -> KvAck:
        if self._managers.pop(message.replica_id, None) is not None:
            log.info("dropped pool of replica %d", message.replica_id)
        return KvAck(None)

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
                return sum(manager.clear() for manager in self._managers.values())
            manager = self._managers.get(replica_id)
            return None if manager is None else manager.clear()


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

    def __init__(self, pools: KvCachePools) -> None:
        self.pools = pools

    async def Stats(self, request: kvcache_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> kvcache_pb2.StatsResponse:
        pools, num_plans = self.pools.stats()
        return kvcache_pb2.StatsResponse(
            pools=[_stats_to_pb(replica_id, stats) for replica_id, stats in pools.items()],
            num_plans=num_plans)

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
        hit_rate=stats.hit_rate,
        num_requests=stats.num_requests,
    )


class KvCacheServer:
    """Binds the plan socket and the admin server, starts both, stops both."""

    def __init__(self, host: str, plan_port: int, admin_port: int,
                 on_fatal: Callable[[], None]) -> None:
        self.host = host
        self.plan_port = plan_port
        self.admin_port = admin_port
        self.pools = KvCachePools()
        self._on_fatal = on_fatal
        self._ctx: zmq.Context | None = None
        self._plan_loop: PlanLoop | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: Health | None = None

    @property
    def plan_address(self) -> str:
        return tcp_address(self.host, self.plan_port)

    @property
    def failed(self) -> bool:
        return self._plan_loop is not None and self._plan_loop.failed

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

        server = make_server()
        kvcache_pb2_grpc.add_KvCacheAdminServicer_to_server(KvCacheAdminServicer(self.pools),
                                                            server)
        health = Health(server, [ADMIN_SERVICE_NAME])
        try:
            self.admin_port = bind(server, self.host, self.admin_port)
        except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError for a taken port
            plan_loop.stop()
            ctx.term()
            raise OSError(f"cannot bind admin port {self.host}:{self.admin_port}: "
                          f"{exc}") from exc
        self._ctx, self._plan_loop, self._grpc, self._health = ctx, plan_loop, server, health
        await self._grpc.start()
        await self._health.set_live()
        self._plan_loop.start()
        await self._health.set_ready(True)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._health is not None:
            await self._health.shutdown()
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._plan_loop is not None:
            self._plan_loop.stop()
        if self._ctx is not None:
            self._ctx.term()
