"""`X-Request-Id` on every response, as vLLM's server sends it (`--enable-request-id-headers`):
the client's own header echoed back, or a fresh id where it sent none (or one that is not a
short printable token, which is not echoed into a header). A pure ASGI middleware, so streamed
responses carry it too."""

import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

HEADER = b"x-request-id"
MAX_LENGTH = 256
PRINTABLE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LENGTH)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def request_id(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The client's X-Request-Id when it is usable, else a new one."""
    given = next((v for k, v in headers if k.lower() == HEADER), None)
    if given is not None and PRINTABLE.fullmatch(given):
        return given
    return uuid.uuid4().hex.encode()


class RequestIdMiddleware:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(list(scope.get("headers") or ()))
        scope.setdefault("state", {})["request_id"] = rid.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers") or ()
                           if k.lower() != HEADER]
                message["headers"] = [*headers, (HEADER, rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)
