"""Server-sent events from the scheduler's chunks, driven with stand-in calls (no network):
the event order of a chat and of a batch of completions, the usage event, [DONE] last, an
error after the start as an error event, and every call cancelled however the stream ends."""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from http_svc.errors import ApiError
from http_svc.sampling import Sampling
from http_svc.scheduler_client import Chunk, TokenLogprob, Usage
from http_svc.streaming import (
    DONE,
    EventStream,
    Started,
    StreamHead,
    chat_events,
    completion_events,
)

HEAD = StreamHead("id-1", "chat.completion.chunk", 1700000000, "smol")
SAMPLING = Sampling(0.0, 1.0, 0, None, 16, 0, (), (), False, None, False)


class FakeCall:
    """Yields its chunks (waiting `delay_s` before each but the first), then raises `error`
    if given."""

    def __init__(self, chunks: Sequence[Chunk], error: Exception | None = None,
                 delay_s: float = 0.0) -> None:
        self._chunks = self._read(list(chunks), error, delay_s)
        self.cancelled = False

    async def _read(self, chunks: list[Chunk], error: Exception | None,
                    delay_s: float) -> AsyncIterator[Chunk]:
        for i, chunk in enumerate(chunks):
            await asyncio.sleep(delay_s if i else 0)
            yield chunk
        if error is not None:
            raise error

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks

    async def next(self) -> Chunk:
        return await anext(self._chunks)

    def cancel(self) -> None:
        self.cancelled = True


def final(text: str, num_tokens: int = 1, reason: str = "length") -> Chunk:
    return Chunk(tuple(range(num_tokens)), text, (), reason, None, Usage(4, num_tokens, 0))


async def started(*calls: FakeCall) -> list[Started]:
    return [Started(c, await c.next()) for c in calls]  # type: ignore[arg-type]


def read(make: Callable[[], Awaitable[EventStream]]) -> list[Any]:
    """The events of the stream `make` builds, all in one event loop (asyncio.run closes the
    async generators a loop started)."""
    async def run() -> list[bytes]:
        return [event async for event in (await make()).events]
    events = asyncio.run(run())
    assert events[-1] == DONE
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


def test_a_chat_stream_opens_with_the_role_and_ends_with_usage() -> None:
    call = FakeCall([Chunk((5,), "Hel", ()), Chunk((6,), "", ()), Chunk((7,), "lo", ()),
                     final("!", 3, "stop")])
    async def make() -> EventStream:
        return chat_events(HEAD, "assistant", (await started(call))[0], SAMPLING, None, True)
    events = read(make)
    assert [e["choices"] for e in events] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
          "finish_reason": None}],
        [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None,
          "stop_reason": None}],
        # the chunk that only held back half a character sends nothing
        [{"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": None,
          "stop_reason": None}],
        [{"index": 0, "delta": {"content": "!"}, "logprobs": None, "finish_reason": "stop",
          "stop_reason": None}],
        []]
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3,
                                   "total_tokens": 7, "prompt_tokens_details": {
                                       "cached_tokens": 0}}
    assert {(e["id"], e["object"], e["model"]) for e in events} == {
        ("id-1", "chat.completion.chunk", "smol")}
    assert call.cancelled


def test_chat_logprobs_come_with_their_chunk() -> None:
    lp = TokenLogprob(1, -0.5, ((1, -0.5),))
    call = FakeCall([Chunk((1,), "b", (lp,), "length", None, Usage(4, 1, 0))])
    sampling = Sampling(0.0, 1.0, 0, None, 16, 0, (), (), False, 1, False)
    async def make() -> EventStream:
        return chat_events(HEAD, "assistant", (await started(call))[0], sampling, ["a", "b"],
                           False)
    events = read(make)
    assert events[1]["choices"][0]["logprobs"] == {"content": [
        {"token": "b", "logprob": -0.5, "bytes": [98],
         "top_logprobs": [{"token": "b", "logprob": -0.5, "bytes": [98]}]}]}
    assert "usage" not in events[-1]


def test_a_batch_of_completions_interleaves_by_index() -> None:
    slow = FakeCall([Chunk((1,), "a", ()), final("b")], delay_s=0.1)
    fast = FakeCall([Chunk((1,), "x", ()), Chunk((2,), "y", ()), final("z")])
    head = StreamHead("cmpl-1", "text_completion", 1, "smol")
    async def make() -> EventStream:
        return completion_events(head, await started(slow, fast), SAMPLING, None, True)
    events = read(make)
    texts = [(c["index"], c["text"]) for e in events for c in e["choices"]]
    assert texts[:2] == [(0, "a"), (1, "x")]            # each stream's first chunk first
    assert sorted(texts) == [(0, "a"), (0, "b"), (1, "x"), (1, "y"), (1, "z")]
    assert [t for i, t in texts if i == 1] == ["x", "y", "z"]
    assert events[-1]["usage"]["completion_tokens"] == 2
    assert slow.cancelled and fast.cancelled


def test_completion_text_offsets_run_across_chunks() -> None:
    lp = TokenLogprob(1, -0.5, ())
    call = FakeCall([Chunk((1, 1), "bb", (lp, lp)),
                     Chunk((1,), "b", (lp,), "length", None, Usage(1, 3, 0))])
    sampling = Sampling(0.0, 1.0, 0, None, 3, 0, (), (), False, 0, False)
    head = StreamHead("cmpl-1", "text_completion", 1, "smol")
    async def make() -> EventStream:
        return completion_events(head, await started(call), sampling, ["a", "b"], False)
    events = read(make)
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in events] == [[0, 1], [2]]


def test_an_error_after_the_start_is_an_error_event() -> None:
    call = FakeCall([Chunk((1,), "a", ())], ApiError(503, "replica lost"))
    other = FakeCall([Chunk((1,), "x", ()), final("y")], delay_s=60)   # cancelled, not awaited
    head = StreamHead("cmpl-1", "text_completion", 1, "smol")
    async def make() -> EventStream:
        return completion_events(head, await started(call, other), SAMPLING, None, True)
    events = read(make)
    assert events[-1] == {"error": {"message": "replica lost",
                                    "type": "ServiceUnavailableError", "param": None,
                                    "code": 503}}
    assert call.cancelled and other.cancelled


def test_a_stream_never_read_still_cancels_its_calls() -> None:
    call = FakeCall([final("a")])

    async def run() -> None:
        chat_events(HEAD, "assistant", (await started(call))[0], SAMPLING, None, False).cancel()
    asyncio.run(run())
    assert call.cancelled
