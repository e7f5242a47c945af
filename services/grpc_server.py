"""What every splitserve gRPC server carries: grpc.health.v1, server reflection, a bound on
the request size, and INVALID_ARGUMENT for requests that do not parse.

Each service builds its `grpc.aio.Server` with `make_server`, adds its servicers, then builds
`Health(server, names)` with the full service names it serves.

grpc deserializes a request before any servicer code runs, and a parse error there (corrupt
wire format, invalid UTF-8 in a string field) would reach the client as UNKNOWN "Unexpected
<class 'DecodeError'>". `ParseErrorInterceptor` swaps every unary-request handler's
deserializer for one that hands the error on as an `UnparsedRequest`, and answers that with
INVALID_ARGUMENT before the servicer method is called.
"""

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.cluster_token import TokenInterceptor

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20  # requests and responses, unless a server sets a smaller bound

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def server_options(max_receive_bytes: int, reuse_port: bool = False) -> list[tuple[str, int]]:
    return [
        # grpc refuses a larger request (RESOURCE_EXHAUSTED) before buffering it whole.
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Off unless several processes share the port on purpose: on, a port another process
        # holds would bind without a word.
        ("grpc.so_reuseport", int(reuse_port)),
    ]


def make_server(max_receive_bytes: int = MAX_MESSAGE_BYTES,
                cluster_token: str | None = None, reuse_port: bool = False,
                first: Iterable[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """`cluster_token`: an internal listener's; every call but health checks must carry it
    (services.cluster_token.TokenInterceptor). None: a public listener. `reuse_port`: the
    scheduler's front ends, which share the client port. `first`: interceptors that run
    before the parse check (a public port's API keys: scheduler_svc.frontend.auth)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [*first, ParseErrorInterceptor()]
    if cluster_token is not None:
        interceptors.insert(0, TokenInterceptor(cluster_token))
    return grpc.aio.server(options=server_options(max_receive_bytes, reuse_port),
                           interceptors=interceptors)


class UnparsedRequest:
    """Stands in for a request whose bytes did not parse; carries the parser's message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or whatever a custom parser raises
            return UnparsedRequest(str(exc) or type(exc).__name__)
    return deserialize


async def _refuse(request: UnparsedRequest, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request could not be parsed: {request.error}")


def _guard_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, UnparsedRequest):
            await _refuse(request, context)
        return await behavior(request, context)
    return unary


def _guard_stream(behavior: Callable[..., AsyncIterator[Any]],
                  ) -> Callable[..., AsyncIterator[Any]]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, UnparsedRequest):
            await _refuse(request, context)
        async for response in behavior(request, context):
            yield response
    return stream


class ParseErrorInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT for unary requests that fail to parse (see the module docstring).

    Only async unary-request handlers are wrapped: a sync behavior must stay sync (grpc runs it
    in a thread), and a streamed request (reflection's) is parsed message by message while the
    servicer iterates, where no status can be chosen for it; splitserve's own RPCs are all
    unary-request. Wrapped handlers are cached per
    method, so a call costs one dict lookup."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _wrap(handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def _wrap(handler: Any) -> Any:
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    deserializer = _tolerant(handler.request_deserializer)
    if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
        return handler._replace(unary_unary=_guard_unary(handler.unary_unary),
                                request_deserializer=deserializer)
    if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
        return handler._replace(unary_stream=_guard_stream(handler.unary_stream),
                                request_deserializer=deserializer)
    if handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
        # A streaming handler that writes with context.write (grpc.health.v1 Watch).
        return handler._replace(unary_stream=_guard_unary(handler.unary_stream),
                                request_deserializer=deserializer)
    return handler


def bind(server: grpc.aio.Server, host: str, port: int,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Binds host:port (port 0 picks one) and returns the port; fails loudly if taken.
    `credentials`: TLS (services.tls), else plaintext."""
    try:
        bound = (server.add_insecure_port(f"{host}:{port}") if credentials is None
                 else server.add_secure_port(f"{host}:{port}", credentials))
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
