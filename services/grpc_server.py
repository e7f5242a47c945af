"""What every splitserve gRPC server carries: grpc.health.v1, server reflection, and an
interceptor-free way to map core exceptions to status codes.

Each service builds its `grpc.aio.Server` with `make_server`, adds its servicers, then calls
`enable_health_and_reflection` with the full service names it serves.
"""

import logging
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20  # requests and responses; a prompt is far smaller

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def make_server() -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Binds host:port (port 0 picks one) and returns the port; fails loudly if taken."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpcio raises on a taken port; older versions returned 0
        raise OSError(f"cannot bind gRPC port {host}:{port}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    return bound


class Health:
    """grpc.health.v1 servicer plus reflection. Liveness is the empty service name ("" is
    SERVING while the process runs); readiness is each named service's status."""

    def __init__(self, server: grpc.aio.Server, service_names: Iterable[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.service_names = list(service_names)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)

    async def set_live(self) -> None:
        await self.servicer.set("", health_pb2.HealthCheckResponse.SERVING)

    async def set_ready(self, ready: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.service_names:
            await self.servicer.set(name, status)

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()
