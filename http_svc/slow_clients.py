"""Clients that hold a connection without finishing a request, and connections past the cap.

uvicorn (h11) waits for a request's headers and body for as long as the client likes, and a
new connection that never sends a byte is kept forever: 20 clients that send half a request
and stop hold 20 connections and their buffers. `GuardedH11Protocol` is uvicorn's h11 protocol
with two additions, made by `protocol_factory` from the config and passed as uvicorn's `http`:

- a read deadline: from a connection's start, or the first byte of its next request, the
  request's headers and body must all arrive within `request_read_timeout_s`. Past it the
  client gets a 408 error object (when it sent part of a request and no response has begun)
  and the connection is closed. An idle keep-alive connection between requests is left to
  uvicorn's own keep-alive timeout, as before;
- a cap on open connections: a connection opened while `max_connections` others are open has
  its request read (under the same deadline) and answered 503 with `Connection: close`.

Refusals go to a rate-limited log (services.refusal_log): one line per client address and
interval, so a flood of slow clients cannot flood the log. A request whose body stops coming
is seen by the app as a client that left; `QuietDisconnectMiddleware` ends such a request
without an error log (nobody is there to answer).
"""

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import h11
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from http_svc.errors import ApiError
from services.refusal_log import RefusalLog

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1       # what a client refused for the connection cap is told to wait


def over_capacity_app(max_connections: int) -> ASGIApp:
    """The app a connection past the cap is served by: 503, then the connection closes."""
    error = ApiError(503, f"the server has {max_connections} open connections, its limit "
                          f"(--max-connections); retry later")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse(error.body(), status_code=503, headers={
            "connection": "close", "retry-after": str(RETRY_AFTER_S)})
        await response(scope, receive, send)

    return app


def timeout_response(read_timeout_s: float) -> bytes:
    """A whole 408 response, written to the socket as is (no request may have been parsed)."""
    body = json.dumps(ApiError(408, f"the request was not sent within {read_timeout_s:g} s "
                                    f"(--request-read-timeout)").body()).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request read deadline and a connection cap."""

    def __init__(self, *args: Any, read_timeout_s: float, max_connections: int,
                 refusals: RefusalLog, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.refusals = refusals
        self.read_timer: asyncio.TimerHandle | None = None
        self.num_request_bytes = 0      # received since the read deadline was set

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.app = over_capacity_app(self.max_connections)
            self.refusals.refused(self.peer(), f"over the cap of {self.max_connections} open "
                                               f"connections: answered 503")
        self.start_read_deadline()

    def data_received(self, data: bytes) -> None:
        if self.read_timer is None and self.conn.their_state is h11.IDLE:
            self.start_read_deadline()     # the first bytes of the next request
        self.num_request_bytes += len(data)
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE and self.cycle is not None and self.cycle.response_complete and (
                not self.conn.trailing_data[0]):
            # The rest of a body answered early (415, 413) came in: the connection is idle
            # until its next request, under uvicorn's keep-alive timeout (which uvicorn
            # stopped on these bytes and would not start again).
            self.stop_read_deadline()
            if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler)
        elif state is not h11.IDLE and state is not h11.SEND_BODY:
            self.stop_read_deadline()      # read whole (or the connection is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_read_deadline()
        super().connection_lost(exc)

    def start_read_deadline(self) -> None:
        self.stop_read_deadline()
        self.num_request_bytes = 0
        self.read_timer = self.loop.call_later(self.read_timeout_s, self.read_timed_out)

    def stop_read_deadline(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def read_timed_out(self) -> None:
        self.read_timer = None
        if self.transport.is_closing():
            return
        if self.num_request_bytes:      # part of a request (a silent connection just closes)
            self.refusals.refused(self.peer(), f"request not sent within "
                                               f"{self.read_timeout_s:g} s: closed")
            # The request being read, when its headers came in (else only part of them did).
            cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
            if cycle is None or not cycle.response_started:
                if cycle is not None:
                    # The app waits for the rest of the body: it sees the client leave, and
                    # whatever it answers is dropped (this 408 is the answer).
                    cycle.disconnected = True
                    cycle.message_event.set()
                self.transport.write(timeout_response(self.read_timeout_s))
        self.transport.close()

    def peer(self) -> str:
        return self.client[0] if self.client else ""


def protocol_factory(read_timeout_s: float, max_connections: int
                     ) -> Callable[..., GuardedH11Protocol]:
    """uvicorn's `http` setting: it makes each connection's protocol with its own arguments."""
    refusals = RefusalLog(log, "HTTP connections")
    return functools.partial(GuardedH11Protocol, read_timeout_s=read_timeout_s,
                             max_connections=max_connections, refusals=refusals)


class QuietDisconnectMiddleware:
    """Ends a request whose client left (or was cut off) while its body was read, without the
    error log and 500 an unexpected exception gets: there is nobody to answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            if scope["type"] == "http":
                log.debug("%s %s: the client left before its body was read", scope["method"],
                          scope["path"])
