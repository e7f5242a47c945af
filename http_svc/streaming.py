"""Streamed responses as server-sent events: one `data: {json}` event per chunk, then
`data: [DONE]`, as OpenAI's and vLLM's servers stream.

With `n` choices per prompt, one scheduler stream carries them all, each chunk naming its
choice; prompt i's choice j is the response's choice i * n + j (as vLLM numbers them). With
`echo`, a choice's first event starts with the prompt text.

Chat streams open with a chunk per choice that carries only the role; each scheduler chunk that
brings text, logprobs or the finish reason becomes one event (a chunk that only held back half
a character is skipped), its text read by a `ReplyReader` (http_svc.replies) into content,
reasoning_content and tool_calls deltas (text that may begin a tool call or a think tag waits
for the next chunk). With `stream_options.include_usage` a last event carries the usage and
no choices; with `continuous_usage_stats` too, every event carries its choice's usage so far
(vLLM's). An error after the stream began is sent as an event holding the error object (the
`openai` client raises it), then `[DONE]`.

A batch of prompts keeps a bounded number of calls open (http_svc.outputs.MAX_CALLS_IN_FLIGHT):
the first prompts' calls start before the response, and each later prompt's call opens as one
of those ends; its choices keep their indices, whenever their events come.

The stream owns its generation calls: however it ends (finished, failed, or the client gone,
which cancels it), every call is cancelled, so the scheduler aborts what is still running,
and no later prompt's call opens.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from http_svc.errors import ApiError
from http_svc.outputs import (
    chat_delta,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    echo_logprobs,
    running_usage,
    usage_body,
)
from http_svc.replies import ReplyReader, merge
from http_svc.sampling import Sampling
from http_svc.scheduler_client import Chunk, GenerationCall, TokenLogprob, Usage

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class EventStream:
    """A streamed response's events and the calls they come from. `cancel()` (idempotent) is
    for a response that ends before its events were read: an async generator never started
    runs no `finally`."""

    events: AsyncIterator[bytes]
    calls: Sequence[GenerationCall]

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


@dataclass(frozen=True, slots=True)
class Started:
    """A generation whose first chunk has arrived (so refusals became an HTTP status)."""

    call: GenerationCall
    first: Chunk


@dataclass(frozen=True, slots=True)
class StreamHead:
    """What every event of one response repeats."""

    id: str
    object: str          # "text_completion" or "chat.completion.chunk"
    created: int
    model: str

    def event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse({"id": self.id, "object": self.object, "created": self.created,
                    "model": self.model, "choices": choices, **extra})


async def merged(streams: Sequence[Started], n: int = 1,
                 more: Sequence[Callable[[], GenerationCall]] = (),
                 ) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) of every stream as they come, each started stream's first chunk
    first; stream i's choice j is choice i * n + j. `more`: the streams after `streams`, each
    opened as one before it ends (see `_merged`)."""
    async for i, chunk in _merged(streams, n, more):
        yield i * n + chunk.index, chunk


async def _merged(streams: Sequence[Started], n: int,
                  more: Sequence[Callable[[], GenerationCall]] = (),
                  ) -> AsyncIterator[tuple[int, Chunk]]:
    """(stream index, chunk) of every stream as they come, each started stream's first chunk
    first (a stream whose first chunk ends it is done, unless it carries several choices).
    Stream len(streams) + j is `more[j]()`, opened when one of the streams before it ends:
    never more than len(streams) calls are open at once. The first error of any stream is
    raised here; however the reading ends, every call opened here is cancelled."""
    for i, s in enumerate(streams):
        yield i, s.first
    ongoing = [(i, s.call) for i, s in enumerate(streams)
               if s.first.finish_reason is None or n > 1]
    if len(ongoing) == 1 and not more:
        i, call = ongoing[0]
        async for chunk in call:
            yield i, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk] | Exception | None] = asyncio.Queue()
    later = iter(enumerate(more, start=len(streams)))

    async def pump(i: int, call: GenerationCall) -> None:
        try:
            async for chunk in call:
                queue.put_nowait((i, chunk))
        finally:
            call.cancel()

    async def run(first: tuple[int, GenerationCall] | None) -> None:
        """`first`'s chunks, then the next of `more`'s, one by one, until none is left."""
        try:
            if first is not None:
                await pump(*first)
            for j, open_call in later:
                await pump(j, open_call())
            queue.put_nowait(None)
        except Exception as exc:         # the stream's own failure: the reader raises it
            queue.put_nowait(exc)

    firsts: list[tuple[int, GenerationCall] | None] = [*ongoing]
    firsts += [None] * min(len(streams) - len(ongoing), len(more))
    runners = [asyncio.create_task(run(first)) for first in firsts]
    try:
        num_running = len(runners)
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)


def completion_events(head: StreamHead, streams: Sequence[Started], sampling: Sampling,
                      vocab: Sequence[str] | None, include_usage: bool,
                      echoes: Sequence[str] | None = None,
                      first_ids: Sequence[int] | None = None,
                      prompt_tokens: Sequence[int] | None = None,
                      more: Sequence[Callable[[], GenerationCall]] = ()) -> EventStream:
    """`streams`: the first prompts' generations, started; `more`: how to open each later
    prompt's, each as one before it ends (so no more calls are open at once than
    `streams`). `echoes`: each prompt's text, to start its choices' text with (echo);
    `first_ids`: each prompt's first token, where the echo comes with logprobs (then the
    prompt's tokens lead each choice's logprobs, their logprobs from choice 0's first
    chunk); `prompt_tokens`: each prompt's length, for usage on every event (continuous
    usage)."""
    n = sampling.n
    num_prompts = len(streams) + len(more)
    num_choices = num_prompts * n
    counts = [0] * num_choices         # tokens generated so far per choice
    num_chars = [0] * num_choices      # text sent so far per choice: logprobs' text_offset
    usages: list[Usage | None] = [None] * num_choices
    echo_pending = [bool(echoes)] * num_choices
    prompt_lps: list[tuple[TokenLogprob, ...]] = [()] * num_prompts

    async def events() -> AsyncIterator[bytes]:
        async for i, chunk in merged(streams, n, more):
            text = chunk.text
            prompt_lps[i // n] = prompt_lps[i // n] or chunk.prompt_logprobs
            echo_now = bool(echoes) and echo_pending[i]
            if echoes and echo_now:
                text, echo_pending[i] = echoes[i // n] + text, False
                num_chars[i] += len(echoes[i // n])
            elif not (chunk.text or chunk.logprobs or chunk.finish_reason):
                continue
            logprobs = None
            if vocab is not None and sampling.logprobs is not None:
                if echo_now and first_ids is not None:
                    first, lps = first_ids[i // n], prompt_lps[i // n]
                    num_chars[i] = len(vocab[first]) + sum(len(vocab[lp.token_id])
                                                           for lp in lps)
                    logprobs = echo_logprobs(vocab, first, lps, sampling.logprobs,
                                             completion_logprobs(vocab, chunk.logprobs,
                                                                 sampling.logprobs,
                                                                 num_chars[i]))
                else:
                    logprobs = completion_logprobs(vocab, chunk.logprobs, sampling.logprobs,
                                                   num_chars[i])
            num_chars[i] += len(chunk.text)
            usages[i] = chunk.usage or usages[i]
            counts[i] += len(chunk.token_ids)
            extra = {} if prompt_tokens is None else {
                "usage": running_usage(prompt_tokens[i // n], counts[i])}
            yield head.event([completion_choice(i, text, logprobs, chunk, sampling)], **extra)
        if include_usage:
            yield head.event([], usage=usage_body(_all(usages), n))

    calls = [s.call for s in streams]
    return EventStream(_guarded(events(), calls), calls)


def chat_events(head: StreamHead, role: str, started: Started, sampling: Sampling,
                vocab: Sequence[str] | None, include_usage: bool, echo: str = "",
                reader: Callable[[], ReplyReader] = ReplyReader,
                prompt_tokens: int | None = None) -> EventStream:
    """`echo`: the last message's content, to start every choice's content with; `reader`
    makes each choice's ReplyReader; `prompt_tokens`: the prompt's length, for usage on
    every event (continuous usage)."""
    n = sampling.n
    readers = [reader() for _ in range(n)]
    counts = [0] * n

    def usage(i: int) -> dict[str, Any]:
        return {} if prompt_tokens is None else {"usage": running_usage(prompt_tokens,
                                                                        counts[i])}

    async def events() -> AsyncIterator[bytes]:
        for i in range(n):
            yield head.event([{"index": i, "delta": {"role": role, "content": echo},
                               "logprobs": None, "finish_reason": None}], **usage(i))
        usages: list[Usage | None] = [None] * n
        async for i, chunk in merged([started], n):
            delta = readers[i].feed(chunk.text)
            if chunk.finish_reason:
                delta = merge(delta, readers[i].finish())
            if not (delta or chunk.logprobs or chunk.finish_reason):
                continue
            logprobs = None
            if vocab is not None and sampling.logprobs is not None:
                logprobs = chat_logprobs(vocab, chunk.logprobs, sampling.logprobs)
            usages[i] = chunk.usage or usages[i]
            counts[i] += len(chunk.token_ids)
            finish = ("tool_calls" if chunk.finish_reason == "stop" and readers[i].made_calls
                      else None)
            yield head.event([chat_delta(i, delta, logprobs, chunk, sampling, finish)],
                             **usage(i))
        if include_usage:
            yield head.event([], usage=usage_body(_all(usages), n))

    return EventStream(_guarded(events(), [started.call]), [started.call])


def _all(usages: Sequence[Usage | None]) -> list[Usage]:
    if any(u is None for u in usages):
        raise ApiError(500, "the scheduler ended a stream without its usage")
    return [u for u in usages if u is not None]


async def _guarded(events: AsyncIterator[bytes],
                   calls: Sequence[GenerationCall]) -> AsyncIterator[bytes]:
    """`events`, then [DONE]; an error becomes an error event; the calls end with it."""
    try:
        try:
            async for event in events:
                yield event
        except ApiError as exc:
            yield sse(exc.body())
        except Exception:
            log.exception("stream failed")
            yield sse(ApiError(500, "internal error while streaming").body())
        yield DONE
    finally:
        for call in calls:
            call.cancel()
