"""Prometheus metrics on the HTTP port, as a vLLM server has them at its own port's /metrics:
the HTTP requests this process served (`HttpMetrics`: counts by handler, method and status
class, sizes, durations), this process's own collectors (process_*, python_*), and the
scheduler's families (`vllm:*` and the rest), read from the scheduler's metrics port at each
scrape, so a Prometheus job or a dashboard pointed at a vLLM server works unchanged here.

The scheduler's scrape is passed through as text, less its process_* and python_* families
(those here are this process's; two of one name would make the scrape invalid). A scheduler
that does not answer costs the scrape its families, not its answer: the HTTP metrics are
still served, with `splitserve:scheduler_metrics_up` 0.

`install(app, ...)` adds the recording middleware and the GET /metrics route.
"""

import asyncio
import logging
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    Summary,
    generate_latest,
)
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

# Fine-grained durations of every request (no labels), and coarse ones per handler.
HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5,
                 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)
HANDLER_BUCKETS = (0.1, 0.5, 1.0)
UNTRACKED = frozenset({"/metrics", "/health"})    # scrapes and probes: not the API's traffic
OWN_PREFIXES = ("process_", "python_")            # families this process exports itself
SCRAPE_TIMEOUT_S = 5.0
MAX_SCRAPE_BYTES = 64 << 20


class HttpMetrics:
    """This process's registry: its HTTP requests and its own process collectors."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter("http_requests_total", "HTTP requests served, by handler, "
                                "method and status class.", ["handler", "method", "status"],
                                registry=r)
        self.request_size = Summary("http_request_size_bytes", "Request body sizes "
                                    "(Content-Length).", ["handler"], registry=r)
        self.response_size = Summary("http_response_size_bytes", "Response body sizes, as "
                                     "sent.", ["handler"], registry=r)
        self.duration_highr = Histogram("http_request_duration_highr_seconds", "Request "
                                        "durations, to the end of the response, in seconds.",
                                        registry=r, buckets=HIGHR_BUCKETS)
        self.duration = Histogram("http_request_duration_seconds", "Request durations per "
                                  "handler, to the end of the response, in seconds.",
                                  ["handler", "method"], registry=r, buckets=HANDLER_BUCKETS)
        self.scheduler_up = Gauge("splitserve:scheduler_metrics_up", "1 if the scheduler's "
                                  "metrics answered this scrape.", registry=r)

    def observe(self, handler: str, method: str, status: int, request_bytes: int,
                response_bytes: int, seconds: float) -> None:
        self.requests.labels(handler, method, f"{status // 100}xx").inc()
        self.request_size.labels(handler).observe(request_bytes)
        self.response_size.labels(handler).observe(response_bytes)
        self.duration_highr.observe(seconds)
        self.duration.labels(handler, method).observe(seconds)


class RecordRequests:
    """ASGI middleware: every HTTP request's handler (its route's path template; "none" for
    a path no route serves), status and sizes, timed to the end of its response (a streamed
    one included). Pure ASGI: a streamed response passes through untouched."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics,
                 routes: Callable[[], Iterable[Any]]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def handler(self, scope: Scope) -> str:
        for route in self.routes():
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return str(getattr(route, "path", "none"))
        return "none"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = self.handler(scope)
        if handler in UNTRACKED:
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 500        # a handler that raised before it answered
        sent = 0

        async def counting_send(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            declared = dict(scope.get("headers") or ()).get(b"content-length", b"0")
            self.metrics.observe(handler, scope["method"], status,
                                 int(declared) if declared.isdigit() else 0, sent,
                                 time.monotonic() - start)


def scheduler_url(configured: str, scheduler_address: str, default_port: int) -> str | None:
    """Where the scheduler's metrics are read: `configured` (an http:// URL; "off": none),
    else its default metrics port on the scheduler's host."""
    if configured == "off":
        return None
    if configured:
        if not configured.startswith(("http://", "https://")):
            raise ValueError(f"--scheduler-metrics: {configured!r} is not an http(s) URL")
        return configured
    host = scheduler_address.rsplit(":", 1)[0] or "127.0.0.1"
    return f"http://{host}:{default_port}/metrics"


def without_own_families(text: str) -> str:
    """The scheduler's exposition, less the families this process exports itself."""
    kept = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") and line.count(" ") >= 2 \
            else line.split("{", 1)[0].split(" ", 1)[0]
        if not name.startswith(OWN_PREFIXES):
            kept.append(line)
    return "\n".join(kept) + "\n" if kept else ""


def read_scheduler(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:  # noqa: S310
        return str(reply.read(MAX_SCRAPE_BYTES).decode())


def install(app: Any, scheduler_metrics: str | None) -> HttpMetrics:
    """Records `app`'s requests and serves GET /metrics on it (`scheduler_metrics`: the
    scheduler's metrics URL, None: this process's metrics only)."""
    metrics = HttpMetrics()
    app.add_middleware(RecordRequests, metrics=metrics, routes=lambda: app.router.routes)
    warned = False

    async def serve_metrics(request: Request) -> Response:
        nonlocal warned
        scheduler = ""
        if scheduler_metrics is not None:
            try:
                scheduler = without_own_families(
                    await asyncio.to_thread(read_scheduler, scheduler_metrics))
                metrics.scheduler_up.set(1)
                warned = False
            except (OSError, ValueError) as exc:
                metrics.scheduler_up.set(0)
                if not warned:      # once per outage: Prometheus scrapes every few seconds
                    log.warning("scheduler metrics at %s: %s", scheduler_metrics, exc)
                    warned = True
        body = generate_latest(metrics.registry) + scheduler.encode()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", serve_metrics, methods=["GET"], include_in_schema=False)
    return metrics
