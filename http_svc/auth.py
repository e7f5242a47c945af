"""API keys on the HTTP API (services.api_keys): `ApiKeyMiddleware` answers 401 with an
OpenAI-style error object, before any route runs, to a request without `Authorization: Bearer
<key>` of a configured key. Open without a key: /health, /ping and /version (probes carry no
key), /metrics (Prometheus scrapers carry none; vLLM leaves it open too), and CORS
preflights (OPTIONS, which browsers send without credentials).

Whatever key the client presented, checked here or not, is passed on to the scheduler with
every gRPC call made for the request (`presented_key`, read by http_svc.scheduler_client), so
one key list, the scheduler's, can serve both APIs, and an Abort by the scheduler knows whose
request it is. Without keys, the HTTP client's address (host only) is passed on instead
(`client_host`): the scheduler queues each client's requests in turn, and every call of
http_svc would otherwise be one client, http_svc's own. (With keys, the key is the client.)
A plain ASGI middleware: a streamed response passes through it untouched.
"""

from contextvars import ContextVar

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from http_svc.errors import ApiError
from services.api_keys import ApiKeys, bearer

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})

# The key the HTTP client presented (None: none), for the gRPC calls made on its behalf.
presented_key: ContextVar[str | None] = ContextVar("presented_key", default=None)
# The HTTP client's host when the port has no keys (None: keys on, or no address known), for
# the scheduler's turns between clients (http_svc.scheduler_client sends it).
client_host: ContextVar[str | None] = ContextVar("client_host", default=None)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        key = bearer(header)
        if (self.keys and scope["method"] != "OPTIONS" and scope["path"] not in OPEN_PATHS
                and (why := self.keys.refusal(key)) is not None):
            error = ApiError(401, why)
            response = JSONResponse(error.body(), status_code=401,
                                    headers={"www-authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        token = presented_key.set(key)
        peer = scope.get("client")
        host = client_host.set(str(peer[0]) if peer and not self.keys else None)
        try:
            await self.app(scope, receive, send)
        finally:
            client_host.reset(host)
            presented_key.reset(token)
