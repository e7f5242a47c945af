"""http_svc.request_body: a large body is decoded and validated on the reader's own thread
(started on its first large body if the app's lifespan did not), a small one on the event
loop, with the same results and the same 400s and 413s either way; the reader's threads stay
one."""

import asyncio
import json
import threading
from typing import Any

import pytest
from pydantic import BaseModel, field_validator
from starlette.requests import Request

from http_svc.errors import ApiError
from http_svc.request_body import OFF_LOOP_BYTES, BodyReader

MAX_BYTES = 4 * OFF_LOOP_BYTES


SEEN: dict[str, str] = {}     # the thread the last Body was validated on


class Body(BaseModel):
    text: str
    items: list[int] = []

    @field_validator("text")
    @classmethod
    def on_thread(cls, value: str) -> str:
        SEEN["thread"] = threading.current_thread().name
        return value


def request(data: bytes, parts: int = 3) -> Request:
    size = -(-len(data) // parts) or 1
    chunks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers},
                   receive)


def parse(reader: BodyReader, data: bytes) -> Body:
    return asyncio.run(reader.parse(request(data), Body))


@pytest.fixture
def reader() -> Any:
    reader = BodyReader(MAX_BYTES)
    yield reader
    reader.close()


def test_a_large_body_is_validated_off_the_loop_with_the_same_result(
        reader: BodyReader) -> None:
    small = {"text": "a", "items": [1, 2]}
    assert parse(reader, json.dumps(small).encode()).items == [1, 2]
    assert SEEN["thread"] == threading.current_thread().name          # the loop's thread
    large = {"text": "b", "items": list(range(OFF_LOOP_BYTES // 4))}
    data = json.dumps(large).encode()
    assert len(data) > OFF_LOOP_BYTES
    assert parse(reader, data).items == large["items"]
    assert SEEN["thread"].startswith("http-body")


@pytest.mark.parametrize("pad", [0, OFF_LOOP_BYTES])
def test_refusals_are_the_same_on_either_side(reader: BodyReader, pad: int) -> None:
    space = b" " * pad                 # JSON allows it anywhere between tokens
    cases = {
        b"[" * 200 + b"]" * 200: (400, "nested deeper than 128 levels"),
        b'{"text": ': (400, "not valid JSON"),
        b"[1]": (400, "must be a JSON object"),
        b'{"text": 5}': (400, "text"),
        b'{"text": "' + b"x" * MAX_BYTES + b'"}': (413, f"at most {MAX_BYTES}"),
    }
    for data, (status, text) in cases.items():
        with pytest.raises(ApiError) as raised:
            parse(reader, space + data)
        assert raised.value.status == status, (data[:40], raised.value.message)
        assert text in raised.value.message + str(raised.value.param), raised.value.message


def body_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("http-body")}


def test_the_reader_holds_one_thread_from_its_start() -> None:
    before = body_threads()             # other tests' apps' readers, if any
    reader = BodyReader(MAX_BYTES)
    reader.start()                      # the app's lifespan does
    started = body_threads() - before
    assert len(started) == 1
    data = json.dumps({"text": "c", "items": [0] * OFF_LOOP_BYTES}).encode()
    for _ in range(3):
        parse(reader, data)
    assert body_threads() - before == started
    reader.close()
