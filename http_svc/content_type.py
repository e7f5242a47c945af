"""`Content-Type: application/json` on the routes that take a JSON body, checked before any
route runs: anything else (text/plain, form-encoded, multipart, none) is answered 415 with an
error object naming the type received. Parameters are allowed (`application/json;
charset=utf-8`).

Why: a browser page on any origin may POST text/plain, form or multipart bodies without a CORS
preflight; a body declared as JSON it cannot send to another origin unless CORS allows it
(http_svc.cors). Refusing other types keeps a page the user visits from driving a server on
their machine or LAN. The OpenAI clients, lm-eval and guidellm all send application/json;
`curl -d` needs `-H 'content-type: application/json'`.
"""

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from http_svc.errors import ApiError

# The POST routes of http_svc.app whose body is JSON (POST /ping takes none).
JSON_BODY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                             "/tokenize", "/detokenize"})
JSON_TYPE = "application/json"


def media_type(header: bytes | None) -> str:
    """The media type of a Content-Type header, lower case and without its parameters."""
    if header is None:
        return ""
    return header.decode("latin-1").split(";", 1)[0].strip().lower()


class JsonContentTypeMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in JSON_BODY_PATHS):
            header = next((v for k, v in scope["headers"] if k == b"content-type"), None)
            if media_type(header) != JSON_TYPE:
                got = "no Content-Type" if header is None else (
                    f"Content-Type {header.decode('latin-1')[:100]!r}")
                error = ApiError(415, f"the body must be JSON, sent with Content-Type: "
                                      f"{JSON_TYPE}; got {got}")
                await JSONResponse(error.body(), status_code=415)(scope, receive, send)
                return
        await self.app(scope, receive, send)
