"""The ASGI app (FastAPI on Starlette, served by uvicorn): routes, body parsing, error objects.

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with stream: true
    GET  /v1/models                              the served model
    POST /v1/responses                           OpenAI's Responses API (http_svc.responses)
    POST /tokenize, /detokenize                  through the scheduler's tokenizer
    GET  /tokenizer_info                         what a remote tokenizer needs (vLLM's)
    GET  /health, GET|POST /ping                 200 only while a replica can serve, else 503
    GET  /version
    GET  /metrics                                Prometheus (http_svc.metrics)

Routes only parse and answer: a body is read up to `max_body_bytes` (413 past it), parsed
into its request model (400 naming the field; fields it does not declare are ignored with a
rate-limited warning, http_svc.ignored; a large body on a thread of its own,
http_svc.request_body) and handed to `OpenAIServing`. Every response
carries an X-Request-Id (http_svc.request_ids). Every error is
an OpenAI-style error object (`http_svc.errors`), unknown paths included. The scheduler
channel and the readiness watch live as long as the app (its lifespan).
"""

import importlib.metadata
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from http_svc.auth import ApiKeyMiddleware
from http_svc.config import HttpConfig
from http_svc.content_type import JsonContentTypeMiddleware
from http_svc.cors import add_cors
from http_svc.disconnect import ClientGone, unless_disconnected
from http_svc.errors import ApiError
from http_svc.ignored import warn_ignored
from http_svc.metrics import install as install_metrics
from http_svc.metrics import scheduler_url
from http_svc.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    ignored_fields,
)
from http_svc.readiness import Readiness
from http_svc.request_body import BodyReader, validate
from http_svc.request_ids import RequestIdMiddleware
from http_svc.responses import ResponsesRequest, responses
from http_svc.scheduler_client import SchedulerClient
from http_svc.serving import OpenAIServing
from http_svc.slow_clients import QuietDisconnectMiddleware
from http_svc.streaming import EventStream
from services.api_keys import ApiKeys
from services.service_flags import METRICS_PORT

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

def package_version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def warned(parsed: M) -> M:
    """A parsed body, its ignored fields warned about (rate-limited)."""
    warn_ignored(type(parsed).__name__, ignored_fields(parsed))
    return parsed


def respond(result: dict[str, Any] | EventStream) -> Response:
    if isinstance(result, EventStream):
        return StreamingResponse(result.events, media_type="text/event-stream",
                                 background=BackgroundTask(result.cancel))
    return JSONResponse(result)


def build_app(config: HttpConfig) -> FastAPI:
    bodies = BodyReader(config.max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = SchedulerClient(config.scheduler_address, config.scheduler_ssl_ca)
        readiness = Readiness(client.channel, client.forget_model)
        readiness.start()
        app.state.serving = OpenAIServing(client, readiness, config)
        bodies.start()
        try:
            yield
        finally:
            await readiness.stop()
            await client.close()
            bodies.close()

    app = FastAPI(title="splitserve", version=package_version(), lifespan=lifespan)
    install_metrics(app, scheduler_url(config.scheduler_metrics, config.scheduler_address,
                                       METRICS_PORT))
    # The last added runs first: CORS, request ids, API keys, then the body's content type.
    app.add_middleware(QuietDisconnectMiddleware)       # http_svc.slow_clients
    app.add_middleware(JsonContentTypeMiddleware)       # http_svc.content_type: 415
    app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(config.api_keys))   # http_svc.auth
    app.add_middleware(RequestIdMiddleware)
    add_cors(app, config.allowed_origins)               # http_svc.cors: off by default
    version = package_version()

    def serving(request: Request) -> OpenAIServing:
        return request.app.state.serving  # type: ignore[no-any-return]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        if exc.status >= 500:
            log.warning("%s %s: %d %s", request.method, request.url.path, exc.status,
                        exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)    # nobody reads it: the client left

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}").body(),
                            status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = warned(await bodies.parse(request, CompletionRequest))
        return respond(await unless_disconnected(request, serving(request).completions(body)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = warned(await bodies.parse(request, ChatCompletionRequest))
        return respond(await unless_disconnected(request, serving(request).chat(body)))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = warned(await bodies.parse(request, ResponsesRequest))
        return respond(await unless_disconnected(request, responses(serving(request), body)))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return JSONResponse(await serving(request).tokenizer_info())

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse(await serving(request).models())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        raw = await bodies.json(request)
        body = warned(validate(raw, TokenizeChatRequest if "messages" in raw
                               else TokenizeCompletionRequest))
        return JSONResponse(await serving(request).tokenize(body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = warned(await bodies.parse(request, DetokenizeRequest))
        return JSONResponse(await serving(request).detokenize(body))

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])    # vLLM's (SageMaker's) health check
    async def health(request: Request) -> Response:
        readiness = serving(request).readiness
        if not readiness.ready:
            raise ApiError(503, f"not ready: {readiness.why_not}")
        return Response(status_code=200)

    @app.get("/version")
    async def get_version() -> Response:
        return JSONResponse({"version": version})

    return app
