"""A client that disconnects aborts its request.

A streamed response is cancelled by Starlette when the client goes (its StreamingResponse
listens for the disconnect) and the stream then cancels its gRPC calls
(`http_svc.streaming`). Work before a response exists (a whole non-streamed generation, or a
stream's wait for its first chunk) is raced here against the client's disconnect: when the
client goes first, the work is cancelled, its `finally` cancels the gRPC calls, and the
scheduler aborts the requests.
"""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _disconnected(request: Request) -> None:
    # The body has been read whole, so the next message the server has for us is the
    # disconnect (or nothing, until the response is sent).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; ClientGone (and `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
