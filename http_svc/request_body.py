"""A request's JSON body: read up to `--max-body-bytes` (413 past it), its nesting measured
before it is parsed (http_svc.json_limits), parsed, and validated into its request model (400
naming the field). Called by every POST route of http_svc.app.

Why a thread for large bodies: the event loop serves every client, and a body of megabytes
holds it for a while. Measured in-process on the 2-core dev machine (shared, load average
5-9; perf_counter around each step): a 10 MB response_format enum of 1,000,000 items spends
75-140 ms in json.loads and 13 ms in the depth count; 1,000,000 stop strings 25-76 ms in
json.loads and 22-330 ms in pydantic's validation. Past `OFF_LOOP_BYTES` those steps run on
one thread of their own. Each step is one C call that holds the GIL throughout, so the loop
still waits for the step under way, but between steps it serves the others: its longest
stall is one step, not their sum. Through the real services (the slowest GET /version, which
only the loop answers, while each case ran; old and new code in alternating rounds) the
worst stall went from 0.31-0.71 s to 0.15-0.35 s for the enum and from 0.28-0.50 s to
0.21-0.25 s for the stop strings. One thread is enough: under the GIL a second would not
parse faster; large bodies wait their turn there, small ones never do.
"""

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from http_svc.errors import ApiError, bad_request, from_validation
from http_svc.json_limits import MAX_JSON_DEPTH, nested_deeper_than

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

OFF_LOOP_BYTES = 1 << 20   # bodies past this are decoded and validated on the body thread


class BodyReader:
    """Reads request bodies for one app; owns the thread large ones are decoded on."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._thread: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Starts the thread (the app's lifespan does, so that the front end's threads stay
        one count; an app served without one starts it on its first large body)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="http-body")
            self._thread.submit(lambda: None).result()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    def _off_loop(self, fn: Callable[[], T]) -> "asyncio.Future[T]":
        self.start()
        assert self._thread is not None
        return asyncio.wrap_future(self._thread.submit(fn))

    async def read(self, request: Request) -> bytes:
        """The body's bytes, no further than `max_bytes`."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise ApiError(413, f"the request body is {declared} bytes; at most "
                                f"{self.max_bytes} are read")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > self.max_bytes:
                raise ApiError(413, f"the request body is over {self.max_bytes} bytes")
        return bytes(data)

    async def json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object."""
        data = await self.read(request)
        if len(data) <= OFF_LOOP_BYTES:
            return decode(data)
        return await self._off_loop(lambda: decode(data))

    async def parse(self, request: Request, model: type[M]) -> M:
        """The body validated into `model`."""
        data = await self.read(request)
        if len(data) <= OFF_LOOP_BYTES:
            return validate(decode(data), model)
        return await self._off_loop(lambda: validate(decode(data), model))


def decode(data: bytes) -> dict[str, Any]:
    """`data` as a JSON object; a 400 for anything else, or for nesting past MAX_JSON_DEPTH
    (json.loads and every walk after it recurse once per level)."""
    if nested_deeper_than(data, MAX_JSON_DEPTH):
        raise bad_request(f"request body nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(data)
    except ValueError as exc:      # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def validate(body: dict[str, Any], model: type[M]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
