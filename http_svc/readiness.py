"""Whether the cluster can serve, as the scheduler's readiness says: grpc.health.v1 `Watch` on
the service `splitserve.v1.Generation` (SERVING = a ready replica and kvcache_svc reachable),
kept in `ready` for /health and for refusing requests with 503 while no replica can serve
(instead of leaving them to wait for one in the scheduler).

A broken watch (scheduler restarting or gone) counts as not ready and is re-opened after
`retry_s`; each time it opens, `on_connect` runs (the client forgets its cached model card).
"""

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

READINESS_SERVICE = "splitserve.v1.Generation"


class Readiness:
    def __init__(self, channel: grpc.aio.Channel, on_connect: Callable[[], None],
                 retry_s: float = 0.5) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._on_connect = on_connect
        self._retry_s = retry_s
        self.ready = False
        self.why_not = "the scheduler has not answered yet"   # while not ready
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        request = health_pb2.HealthCheckRequest(service=READINESS_SERVICE)
        was_ready: bool | None = None
        while True:
            try:
                connected = False
                async for response in self._stub.Watch(request):
                    if not connected:
                        connected = True
                        self._on_connect()
                    self.ready = response.status == health_pb2.HealthCheckResponse.SERVING
                    self.why_not = ("the scheduler has no ready replica (no worker has joined, "
                                    "or kvcache_svc is unreachable)")
                    if self.ready != was_ready:
                        log.info("scheduler readiness: %s",
                                 "ready" if self.ready else "not ready (no replica can serve)")
                        was_ready = self.ready
            except grpc.aio.AioRpcError as exc:
                self.why_not = f"the scheduler cannot be reached ({exc.code().name})"
                if was_ready is not False:
                    log.warning("scheduler readiness watch: %s: %s", exc.code().name,
                                exc.details())
                    was_ready = False
            self.ready = False
            await asyncio.sleep(self._retry_s)
