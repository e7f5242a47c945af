"""Several choices for one prompt (SamplingParams.n), as requests of their own that share the
prompt's cached blocks. Called by the servicer's Generate between `Frontend.prepare` (which
tokenized and validated the prompt once) and the client stream.

Choice i runs as request `<request_id>-<i>` with the same prompt tokens and sampling, its seed
(when it samples) moved to seed + i mod 2**64, so seeded choices are distinct and each is
reproducible on its own. Choice 0 starts first; the others start when its first output comes
back: by then its prompt's full blocks are committed to the prefix index and their KV is
computed, so every other choice is admitted with that prefix cached instead of computing the
prompt n times. (Started together, all would be planned in one step, before any commit.)

A request that asks for prompt logprobs must compute its whole prompt, so it is given a random
cache salt: no prefix-cache or KV-store hit skips a prompt position. With n > 1 only choice 0
computes them; the others share its salt, so they still reuse its blocks.

Outputs come back as (choice index, output) in the order they arrive. However the consumer
stops, every choice still running is cancelled. An Abort of the request (`aborted` set) ends
the choices not started yet at once, each with an empty "abort" output.
"""

import asyncio
import dataclasses
import secrets
from collections.abc import AsyncIterator

from scheduler_svc.engine.request import FinishReason
from scheduler_svc.frontend.core import Frontend
from scheduler_svc.frontend.prompts import PreparedRequest
from scheduler_svc.frontend.streams import RequestOutput
from scheduler_svc.frontend.validation import MAX_CHOICE_SUFFIX, InvalidRequest
from services.merge_streams import merge_streams
from services.wire import MAX_ID_LEN

SEED_SPAN = 1 << 64


def choice_ids(request_id: str, n: int) -> list[str]:
    return [f"{request_id}-{i}" for i in range(n)]


def split_choices(prepared: PreparedRequest) -> list[PreparedRequest]:
    """One prepared request per choice (the request itself when n is 1)."""
    if prepared.sampling.prompt_logprobs is not None:
        prepared = dataclasses.replace(prepared, cache_salt=secrets.token_bytes(32))
    n = prepared.sampling.n
    if n == 1:
        return [prepared]
    if len(prepared.request_id) > MAX_ID_LEN - MAX_CHOICE_SUFFIX:
        raise InvalidRequest(f"request_id longer than {MAX_ID_LEN - MAX_CHOICE_SUFFIX} "
                             f"characters: with n > 1 each choice's id adds a suffix")
    choices = []
    for i, request_id in enumerate(choice_ids(prepared.request_id, n)):
        seed = prepared.sampling.seed
        sampling = dataclasses.replace(
            prepared.sampling, n=1, seed=None if seed is None else (seed + i) % SEED_SPAN,
            prompt_logprobs=prepared.sampling.prompt_logprobs if i == 0 else None)
        choices.append(dataclasses.replace(prepared, request_id=request_id, sampling=sampling))
    return choices


def _aborted_output(choice: PreparedRequest) -> RequestOutput:
    return RequestOutput(choice.request_id, [], "", [], finish_reason=FinishReason.ABORT,
                         num_prompt_tokens=len(choice.prompt_token_ids))


async def generate_choices(frontend: Frontend, prepared: PreparedRequest,
                           time_remaining: float | None = None,
                           aborted: asyncio.Event | None = None, whole: bool = False,
                           ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) for every choice of `prepared`; raises what `Frontend.generate`
    raises for any choice (the others are cancelled). `whole`: one output per choice (n 1
    only)."""
    choices = split_choices(prepared)
    if len(choices) == 1:
        async for out in frontend.generate(choices[0], time_remaining, whole):
            yield 0, out
        return
    first_output = asyncio.Event()

    async def choice_stream(index: int, choice: PreparedRequest) -> AsyncIterator[RequestOutput]:
        try:
            if index:
                await first_output.wait()
                if aborted is not None and aborted.is_set():
                    yield _aborted_output(choice)
                    return
            async for out in frontend.generate(choice, time_remaining):
                first_output.set()
                yield out
        finally:
            first_output.set()     # a choice that failed never holds the others back

    async for index, out in merge_streams([choice_stream(i, c) for i, c in enumerate(choices)]):
        yield index, out
