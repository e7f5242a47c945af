"""A request's outputs on their way to its client: what one or several engine steps made for
it, with its text (`RequestOutput`), and the stream that hands them to the client's call
(`OutputStream`), merging what waited into one message.

The front end (scheduler_svc.frontend.core) builds a `RequestOutput` for each request a step
message names and puts it on the request's stream; the gRPC servicer takes them off.
"""

import asyncio
import dataclasses
from dataclasses import dataclass

from scheduler_svc.engine.request import FinishReason
from services.wire import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """What one step (or several, merged) produced for one request, for its client."""

    request_id: str
    new_token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_store_loaded_tokens: int = 0   # of num_cached_tokens, loaded from the KV store
    error: str | None = None           # the request ended without finishing (replica lost, ...)
    server_fault: bool = False         # the error is a fault of the server (a failed step),
                                       # not an unavailable one (INTERNAL, not UNAVAILABLE)
    invalid: bool = False              # the replica refused the request as it can never run
                                       # there (longer than its KV pool): INVALID_ARGUMENT
    # On the request's first output, when it asked for them: (prompt token id, its logprobs)
    # for every prompt token from the second on.
    prompt_logprobs: list[tuple[int, TokenLogprobs, int]] | None = None   # (id, lps, rank)


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and logprobs in order,
    the last one's ending and counts, the first's prompt logprobs. For a stream that fell
    behind its engine, or a client that takes the whole output at once: one message for what
    several steps made (none may carry an error)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return dataclasses.replace(
        last, new_token_ids=[t for out in outputs for t in out.new_token_ids],
        text="".join(out.text for out in outputs),
        logprobs=[lp for out in outputs for lp in out.logprobs],
        prompt_logprobs=next((out.prompt_logprobs for out in outputs
                              if out.prompt_logprobs is not None), None))


class OutputStream:
    """One request's outputs on their way from the engine thread to its client stream.

    Outputs that arrive while the stream is busy are sent together as one: a stream that fell
    behind (its event loop busy with many streams, or a slow client) sends one message for
    several steps instead of falling further behind. With `interval` > 1 the stream also waits
    for that many tokens before it wakes (as vLLM's --stream-interval): the first tokens and
    the end go out at once. With `interval` None it wakes only at the end: a client that takes
    the whole output at once (GenerateOnce) costs the event loop nothing per token. An error
    is never merged: the tokens before it go first."""

    def __init__(self, interval: int | None = 1) -> None:
        self.interval = interval
        self._waiting: list[RequestOutput] = []
        self._num_waiting_tokens = 0
        self._sent_tokens = False
        # Set when what waits should go; `get` waits on a bare future of its own rather than
        # an asyncio.Event (no waiter list to walk, no lock object): one stream, one
        # consumer, and this runs once per token.
        self._ready = False
        self._waiter: asyncio.Future[None] | None = None
        self._held: RequestOutput | None = None

    def wants(self, num_unsent_tokens: int) -> bool:
        """Whether the front end should hand over the tokens it holds for this stream now:
        `interval` of them, or the first ones (never, for a whole-output stream: it takes
        them at the end)."""
        if self.interval is None:
            return False
        return num_unsent_tokens >= self.interval or not self._sent_tokens

    def put(self, out: RequestOutput) -> None:
        self._waiting.append(out)
        self._num_waiting_tokens += len(out.new_token_ids)
        if (out.finish_reason is not None or out.error is not None
                or self.interval is not None and (self._num_waiting_tokens >= self.interval
                                                  or not self._sent_tokens)):
            self._ready = True
            waiter = self._waiter
            if waiter is not None and not waiter.done():    # done: its get was cancelled
                waiter.set_result(None)

    async def get(self) -> RequestOutput:
        if self._held is not None:
            out, self._held = self._held, None
            return out
        if not self._ready:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._ready = False
        ready, self._waiting, self._num_waiting_tokens = self._waiting, [], 0
        if len(ready) > 1 and ready[-1].error is not None:
            self._held = ready.pop()
        out = merge_outputs(ready)
        self._sent_tokens = self._sent_tokens or bool(out.new_token_ids)
        return out
