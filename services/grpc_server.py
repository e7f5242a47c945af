"""What every splitserve gRPC server carries: grpc.health.v1, server reflection, a bound on
the request size, INVALID_ARGUMENT for requests that do not parse, and on a public port a
bound on the calls served at once.

Each service builds its `grpc.aio.Server` with `make_server`, adds its servicers, then builds
`Health(server, names)` with the full service names it serves.

grpc deserializes a request before any servicer code runs, and a parse error there (corrupt
wire format, invalid UTF-8 in a string field) would reach the client as UNKNOWN "Unexpected
<class 'DecodeError'>". `ParseErrorInterceptor` swaps every unary-request handler's
deserializer for one that hands the error on as an `UnparsedRequest`, and answers that with
INVALID_ARGUMENT before the servicer method is called.

A public port's calls are bounded by a `CallLimit`: past its count a call is refused at once
with RESOURCE_EXHAUSTED naming the bound's flag; health checks are not counted. Any check in
Python (grpc.aio's own `maximum_concurrent_rpcs` too, which also counts health checks) runs
only once grpc hands a call over. Until then the call waits in grpc's backlog, where grpc
cancels calls at random past `grpc.server.max_pending_requests` (1,000), every newly arriving
one past its hard limit (3,000), and any that waits there 30 s, whoever sent them. So with a
CallLimit the backlog is raised to MAX_PENDING_CALLS, and the limit drains it at its refusal
rate. Measured with a server whose call sleeps 1 s and a client opening 10,000 calls at once
on one channel (2 shared cores): without a bound 3,062 came back CANCELLED; with
maximum_concurrent_rpcs=500, 673 (and a health check was refused); with a CallLimit of 500
alone, 2,709; with the CallLimit and the raised backlog none (8,540 RESOURCE_EXHAUSTED, the
last 4.2 s after the burst), nor at 30,000 calls (the last refused after 16 s). A refusal
costs the server about 150 us of CPU. Other clients' calls and health checks that arrive
during a burst wait in the same backlog, first come first served, until it drains (health
checks: 1.4 s at worst at 10,000 calls, 6.7 s at 30,000).
"""

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.cluster_token import TokenInterceptor, peer_host
from services.refusal_log import RefusalLog

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20  # requests and responses, unless a server sets a smaller bound

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


# grpc's backlog of calls received but not yet handed to the servicer, on a server with a
# CallLimit (see the module docstring): a burst this large is refused, not cancelled, if the
# server refuses it within the 30 s a call may wait there (32,768 refusals at ~150 us: 5 s of
# CPU). A waiting call holds about 9 KB (the server's peak RSS: 129 MiB after a 10,000-call
# burst, 301 MiB after 30,000), so a full backlog is about 300 MiB.
MAX_PENDING_CALLS = 32_768


def server_options(max_receive_bytes: int, reuse_port: bool = False,
                   max_pending_calls: int | None = None) -> list[tuple[str, int]]:
    """`max_pending_calls`: grpc's backlog (None: grpc's default, 1,000 to 3,000)."""
    options = [
        # grpc refuses a larger request (RESOURCE_EXHAUSTED) before buffering it whole.
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Off unless several processes share the port on purpose: on, a port another process
        # holds would bind without a word.
        ("grpc.so_reuseport", int(reuse_port)),
    ]
    if max_pending_calls is not None:
        options += [("grpc.server.max_pending_requests", max_pending_calls),
                    ("grpc.server.max_pending_requests_hard_limit", max_pending_calls)]
    return options


def make_server(max_receive_bytes: int = MAX_MESSAGE_BYTES,
                cluster_token: str | None = None, reuse_port: bool = False,
                first: Iterable[grpc.aio.ServerInterceptor] = (),
                call_limit: "CallLimit | None" = None) -> grpc.aio.Server:
    """`cluster_token`: an internal listener's; every call but health checks must carry it
    (services.cluster_token.TokenInterceptor). None: a public listener. `reuse_port`: the
    scheduler's front ends, which share the client port. `first`: interceptors that run
    before the parse check (a public port's API keys: scheduler_svc.frontend.auth).
    `call_limit`: a public port's bound on calls at once (it runs before everything else,
    and raises grpc's backlog to MAX_PENDING_CALLS)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [*first, ParseErrorInterceptor()]
    if cluster_token is not None:
        interceptors.insert(0, TokenInterceptor(cluster_token))
    if call_limit is not None:
        interceptors.insert(0, call_limit)
    options = server_options(max_receive_bytes, reuse_port,
                             None if call_limit is None else MAX_PENDING_CALLS)
    return grpc.aio.server(options=options, interceptors=interceptors)


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


class HandlerWrapper(grpc.aio.ServerInterceptor):
    """An interceptor that swaps a method's handler for `wrap(handler)`, once per method:
    the wrapped handler is cached, so a call costs one dict lookup. `skip`: method name
    prefixes left as they are."""

    skip: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, handler: Any) -> Any:
        raise NotImplementedError

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self.skip):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


class ParseErrorInterceptor(HandlerWrapper):
    """INVALID_ARGUMENT for unary requests that fail to parse (see the module docstring).

    Only async unary-request handlers are wrapped: a sync behavior must stay sync (grpc runs it
    in a thread), and a streamed request (reflection's) is parsed message by message while the
    servicer iterates, where no status can be chosen for it; splitserve's own RPCs are all
    unary-request."""

    def wrap(self, handler: Any) -> Any:
        return _wrap(handler)


def _wrap(handler: Any) -> Any:
    if handler.request_deserializer is None:
        return handler
    return _rewrapped(handler, _guard_unary, _guard_stream,
                      request_deserializer=_tolerant(handler.request_deserializer)) or handler


def _rewrapped(handler: Any, unary: Callable[[Any], Any], stream: Callable[[Any], Any],
               **fields: Any) -> Any:
    """`handler` with its async unary-request behavior wrapped by `unary` (a coroutine
    function) or `stream` (an async generator function), and `fields` replaced; None for a
    sync or streamed-request handler."""
    if handler.request_streaming:
        return None
    if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
        return handler._replace(unary_unary=unary(handler.unary_unary), **fields)
    if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
        return handler._replace(unary_stream=stream(handler.unary_stream), **fields)
    if handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
        # A streaming handler that writes with context.write (grpc.health.v1 Watch).
        return handler._replace(unary_stream=unary(handler.unary_stream), **fields)
    return None


UNCOUNTED_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class CallLimit(HandlerWrapper):
    """At most `max_calls` calls at once; the next is refused with RESOURCE_EXHAUSTED naming
    `flag` before its servicer runs (see the module docstring). Health checks and reflection
    are neither counted nor refused, so that a health check answers under a flood.

    A call counts from the moment its behavior starts (its request read) until it returns,
    raises or is cancelled, so nothing can leave a count behind; only async unary-request
    behaviors are counted, which every splitserve RPC is. Refusals are logged per peer at
    most once per services.refusal_log interval."""

    skip = UNCOUNTED_SERVICES

    def __init__(self, max_calls: int, flag: str) -> None:
        if max_calls < 1:
            raise ValueError(f"{flag} must be >= 1, got {max_calls}")
        self.max_calls = max_calls
        self.flag = flag
        self.num_calls = 0          # calls running now
        self.num_refused = 0        # calls refused since the start
        self.refusals = RefusalLog(log, f"client calls past {flag} {max_calls}")
        super().__init__()

    def wrap(self, handler: Any) -> Any:
        return _rewrapped(handler, self._counted_unary, self._counted_stream) or handler

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        if self.num_calls >= self.max_calls:
            self.num_refused += 1
            self.refusals.refused(peer_host(context.peer()), f"{self.num_calls} calls open")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this server already serves {self.max_calls} calls at once "
                                f"({self.flag}); try again later")
        self.num_calls += 1

    def _counted_unary(self, behavior: Callable[..., Awaitable[Any]],
                       ) -> Callable[..., Awaitable[Any]]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._admit(context)
            try:
                return await behavior(request, context)
            finally:
                self.num_calls -= 1
        return unary

    def _counted_stream(self, behavior: Callable[..., AsyncIterator[Any]],
                        ) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext,
                         ) -> AsyncIterator[Any]:
            await self._admit(context)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self.num_calls -= 1
        return stream


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
