"""kvcache_svc's edges, bound and started together: the plan loop (ZMQ ROUTER, plan_loop.py),
the admin API (gRPC, admin.py), the KV events (PUB, events.py) and the KV store's socket
(`kv_store.server`). `KvCacheServer` owns their lifetimes and hands the pools (pools.py) to
each. Started by `kvcache_svc.__main__`.
"""

from collections.abc import Callable

import grpc
import zmq

from kvcache_svc.admin import ADMIN_SERVICE_NAME, KvCacheAdminServicer
from kvcache_svc.events import EventPublisher
from kvcache_svc.kv_store.config import KvStoreConfig, build_store
from kvcache_svc.kv_store.server import KvStoreLoop
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.plan_loop import PlanLoop
from kvcache_svc.pools import KvCachePools
from services.channels import tcp_address
from services.grpc_server import Health, bind, make_server
from services.kv_wire import (
    KvEventBatch,
)
from services.rpc.splitserve.v1 import kvcache_pb2_grpc


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
