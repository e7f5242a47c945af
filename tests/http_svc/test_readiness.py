"""The readiness watch against a real grpc.health.v1 server in this process: it follows the
scheduler's readiness as it changes, calls on_connect on every (re)connection, and counts a
scheduler that went away as not ready, saying why."""

import asyncio
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from http_svc.readiness import READINESS_SERVICE, Readiness

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def until(check: Callable[[], bool], timeout_s: float = 10) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def serve(port: int = 0) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await servicer.set(READINESS_SERVICE, NOT_SERVING)
    return server, servicer, bound


def test_readiness_follows_the_scheduler() -> None:
    async def run() -> None:
        server, servicer, port = await serve()
        connects: list[int] = []
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        readiness = Readiness(channel, lambda: connects.append(1), retry_s=0.05)
        readiness.start()
        try:
            assert await until(lambda: len(connects) == 1) and not readiness.ready
            assert "no ready replica" in readiness.why_not
            await servicer.set(READINESS_SERVICE, SERVING)
            assert await until(lambda: readiness.ready)
            await servicer.set(READINESS_SERVICE, NOT_SERVING)
            assert await until(lambda: not readiness.ready)
            await servicer.set(READINESS_SERVICE, SERVING)
            assert await until(lambda: readiness.ready)

            await server.stop(grace=None)              # the scheduler goes away
            assert await until(lambda: not readiness.ready)
            assert await until(lambda: "cannot be reached" in readiness.why_not)
            server, servicer, _ = await serve(port)    # and comes back
            await servicer.set(READINESS_SERVICE, SERVING)
            assert await until(lambda: readiness.ready, timeout_s=30)
            assert len(connects) == 2                  # the cached model card is dropped
        finally:
            await readiness.stop()
            await channel.close()
            await server.stop(grace=None)
    asyncio.run(run())
