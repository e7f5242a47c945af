"""A request's outputs on their way to its client stream (scheduler_svc.frontend.streams):
what waits is sent as one message, in order; --stream-interval holds tokens back until there
are that many, but never the first tokens nor the end; a whole-output stream (GenerateOnce)
wakes only at the end; an error is never merged into tokens."""

import asyncio

import pytest

from scheduler_svc.engine.request import FinishReason
from scheduler_svc.frontend.streams import OutputStream, RequestOutput, merge_outputs
from services.wire import TokenLogprobs


def out(*tokens: int, finish: FinishReason | None = None, error: str | None = None,
        num_output_tokens: int = 0) -> RequestOutput:
    return RequestOutput("r", list(tokens), "".join(f"<{t}>" for t in tokens),
                         [TokenLogprobs(-float(t), [t], [-float(t)]) for t in tokens],
                         finish_reason=finish, num_output_tokens=num_output_tokens,
                         error=error)


async def ready_now(stream: OutputStream) -> RequestOutput | None:
    """The stream's next output if it is ready without waiting for another put."""
    try:
        return await asyncio.wait_for(stream.get(), timeout=0.05)
    except TimeoutError:
        return None


def test_merge_keeps_order_and_takes_the_last_ending() -> None:
    merged = merge_outputs([out(1), out(2, 3), out(4, finish=FinishReason.LENGTH,
                                                   num_output_tokens=4)])
    assert merged.new_token_ids == [1, 2, 3, 4]
    assert merged.text == "<1><2><3><4>"
    assert [lp.logprob for lp in merged.logprobs] == [-1.0, -2.0, -3.0, -4.0]
    assert merged.finish_reason is FinishReason.LENGTH and merged.num_output_tokens == 4


def test_merge_keeps_the_first_outputs_prompt_logprobs() -> None:
    first = out(1)
    first.prompt_logprobs = [(7, TokenLogprobs(-0.5, [7], [-0.5]), 1)]
    merged = merge_outputs([first, out(2), out(3, finish=FinishReason.LENGTH)])
    assert merged.prompt_logprobs == first.prompt_logprobs
    assert merged.new_token_ids == [1, 2, 3]


def test_a_whole_output_stream_wakes_only_at_the_end() -> None:
    async def run() -> None:
        stream = OutputStream(interval=None)
        for t in range(1, 6):
            stream.put(out(t))
        assert await ready_now(stream) is None                 # not even the first token
        stream.put(out(6, finish=FinishReason.LENGTH, num_output_tokens=6))
        whole = await stream.get()
        assert whole.new_token_ids == [1, 2, 3, 4, 5, 6]
        assert whole.finish_reason is FinishReason.LENGTH and whole.num_output_tokens == 6
        assert await ready_now(stream) is None

    asyncio.run(run())


def test_a_whole_output_stream_hands_over_its_tokens_then_the_error() -> None:
    async def run() -> None:
        stream = OutputStream(interval=None)
        stream.put(out(1))
        stream.put(out(2))
        stream.put(out(error="replica lost"))
        tokens = await stream.get()
        assert tokens.new_token_ids == [1, 2] and tokens.error is None
        failed = await stream.get()
        assert failed.error == "replica lost" and failed.new_token_ids == []

    asyncio.run(run())


def test_outputs_that_waited_go_as_one_message() -> None:
    async def run() -> None:
        stream = OutputStream()
        stream.put(out(1))
        assert (await stream.get()).new_token_ids == [1]
        for t in (2, 3, 4):               # three steps while the stream was busy
            stream.put(out(t))
        assert (await stream.get()).new_token_ids == [2, 3, 4]
        assert await ready_now(stream) is None

    asyncio.run(run())


def test_interval_holds_tokens_but_not_the_first_nor_the_end() -> None:
    async def run() -> None:
        stream = OutputStream(interval=3)
        stream.put(out(1))
        assert (await stream.get()).new_token_ids == [1]       # time to first token: at once
        stream.put(out(2))
        stream.put(out(3))
        assert await ready_now(stream) is None                 # 2 < 3 tokens: held
        stream.put(out(4))
        assert (await stream.get()).new_token_ids == [2, 3, 4]
        stream.put(out(5))
        stream.put(out(finish=FinishReason.STOP))              # the end: at once
        last = await stream.get()
        assert last.new_token_ids == [5] and last.finish_reason is FinishReason.STOP

    asyncio.run(run())


@pytest.mark.parametrize("interval", [1, 4])
def test_error_is_not_merged_into_the_tokens_before_it(interval: int) -> None:
    async def run() -> None:
        stream = OutputStream(interval)
        stream.put(out(1))
        await stream.get()
        stream.put(out(2))
        stream.put(out(error="replica lost"))
        tokens = await stream.get()
        assert tokens.new_token_ids == [2] and tokens.error is None
        failed = await stream.get()
        assert failed.error == "replica lost" and failed.new_token_ids == []

    asyncio.run(run())


def test_a_cancelled_get_leaves_the_stream_usable() -> None:
    """The client went away mid-wait (its get cancelled): a later put wakes nobody and
    nothing breaks; the next get takes what waited."""
    async def run() -> None:
        stream = OutputStream()
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)
        stream.put(out(1))
        assert (await stream.get()).new_token_ids == [1]
        stream.put(out(2, finish=FinishReason.STOP))
        assert (await stream.get()).finish_reason is FinishReason.STOP

    asyncio.run(run())
