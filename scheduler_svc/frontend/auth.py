"""API keys on the public gRPC port: `ApiKeyInterceptor` refuses, before any handler runs, a
call that does not present one of the configured keys as metadata `authorization: Bearer
<key>` (services.api_keys), with UNAUTHENTICATED and a message that says whether the key was
missing or wrong (never the key). grpc.health.v1 stays open: load balancers and container
healthchecks carry no key, and it tells only whether the server serves.

Installed only when keys are configured (no keys: the port is open, as it always was). The
front end's servicer reads the key again for who owns a request: each key has its own
request ids, and Abort sees only the caller's (servicer.py, id_space.py).
"""

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.api_keys import ApiKeys, from_metadata
from services.cluster_token import peer_host
from services.refusal_log import RefusalLog

log = logging.getLogger(__name__)

OPEN_SERVICES = ("/grpc.health.v1.Health/",)     # callable without a key

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call but health checks without a configured key."""

    def __init__(self, keys: ApiKeys) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self.keys = keys
        self.refusals = RefusalLog(log, "client calls")
        # Refusing handlers by (method, why): a refused call costs a dict lookup.
        self._refusals: dict[tuple[str, str], grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails,
                                ) -> grpc.RpcMethodHandler | None:
        method = details.method
        if method.startswith(OPEN_SERVICES):
            return await continuation(details)
        why = self.keys.refusal(from_metadata(details.invocation_metadata))
        if why is None:
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:          # no such method: UNIMPLEMENTED, as without keys
            return None
        cached = self._refusals.get((method, why))
        if cached is None:
            cached = self._refusals[(method, why)] = _refusing(handler, method, why,
                                                               self.refusals)
        return cached


def _refusing(handler: grpc.RpcMethodHandler, method: str, why: str,
              refusals: RefusalLog) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED without
    reading its request (it may not even parse)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        refusals.refused(peer_host(context.peer()), f"{method[:200]}: {why}")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext,
                            ) -> AsyncIterator[Any]:
        await refuse(request, context)
        yield  # pragma: no cover  (abort raises)

    def keep(data: bytes) -> bytes:       # the request is never parsed
        return data

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, keep)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, keep)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, keep)
    return grpc.unary_unary_rpc_method_handler(refuse, keep)
