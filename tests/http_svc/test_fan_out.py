"""Bounded fan-out (issue 40): a completions request's prompts times `n`, and chat's `n`, are
capped by --max-prompts-per-request with a 400 naming the field before anything reaches the
scheduler; the calls of an admitted request are opened at most MAX_CALLS_IN_FLIGHT at a
time, all closed once read, and a failure closes the open ones and starts no more. Streamed
too: each choice keeps its index and text, a later prompt's failure is an error event, and
a client gone cancels every open call and opens no more."""

import asyncio
import json
from typing import Any

import pytest

from http_svc.config import HttpConfig
from http_svc.errors import ApiError
from http_svc.outputs import MAX_CALLS_IN_FLIGHT, collect_all
from http_svc.scheduler_client import Chunk, GenerateSpec, Prompt, Usage
from http_svc.serving import OpenAIServing
from http_svc.streaming import DONE, EventStream
from tests.http_svc.test_serving import FakeClient, Ready, chat, completion
from tests.http_svc.test_streaming import FakeCall


def serve_capped(method: str, body: Any, cap: int) -> tuple[Any, FakeClient]:
    client = FakeClient()
    serving = OpenAIServing(client, Ready(), HttpConfig(max_prompts_per_request=cap))  # type: ignore[arg-type]
    return asyncio.run(getattr(serving, method)(body)), client


@pytest.mark.parametrize(("body", "param", "message"), [
    (completion(prompt=["a"] * 5), "prompt", "prompt: 5 prompts x n 1 is more than "
                                             "--max-prompts-per-request 4"),
    (completion(prompt=["a", "b"], n=3), "prompt", "prompt: 2 prompts x n 3"),
    (completion(prompt=[[1, 2]] * 5), "prompt", "prompt: 5 prompts x n 1"),
    (completion(prompt="a", n=5), "n", "n: 1 prompts x n 5"),
    (completion(prompt=[1, 2, 3, 4, 5, 6], n=5), "n", "n: 1 prompts x n 5"),
])
def test_completions_past_the_cap_are_a_400_naming_the_field(body: Any, param: str,
                                                             message: str) -> None:
    client = FakeClient()
    serving = OpenAIServing(client, Ready(), HttpConfig(max_prompts_per_request=4))  # type: ignore[arg-type]
    with pytest.raises(ApiError) as caught:
        asyncio.run(serving.completions(body))
    assert caught.value.status == 400 and caught.value.param == param
    assert message in caught.value.message
    assert client.specs == []            # nothing was sent to the scheduler


def test_chat_n_past_the_cap_is_a_400() -> None:
    with pytest.raises(ApiError) as caught:
        serve_capped("chat", chat(n=5), 4)
    assert caught.value.status == 400 and caught.value.param == "n"


def test_up_to_the_cap_is_served() -> None:
    response, client = serve_capped("completions", completion(prompt=["a", "b", "c", "d"]), 4)
    assert len(response["choices"]) == 4 and len(client.specs) == 4


class CountingClient:
    """Opens FakeCalls that take a while, counting how many are open at once."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.open = self.most_open = 0
        self.calls: list[FakeCall] = []
        self.fail_at = fail_at

    def generate(self, spec: GenerateSpec, whole: bool = False) -> FakeCall:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        error = ApiError(429, "busy") if len(self.calls) == self.fail_at else None
        chunks = [Chunk((1,), "", ()), Chunk((2,), spec.request_id, (), "stop", None,
                                               Usage(1, 2, 0))]
        return tracked(self, FakeCall(chunks[:1] if error else chunks, error, delay_s=0.001))


def tracked(client: Any, call: FakeCall) -> FakeCall:
    """`call`, counted in `client.calls`, its cancel counting it out of `client.open`."""
    original = call.cancel

    def cancel() -> None:
        if not call.cancelled:
            client.open -= 1
        original()
    call.cancel = cancel  # type: ignore[method-assign]
    client.calls.append(call)
    return call


def specs(num: int) -> list[GenerateSpec]:
    return [GenerateSpec(str(i), Prompt(text="x"), None) for i in range(num)]  # type: ignore[arg-type]


def test_calls_are_opened_a_bounded_number_at_a_time_and_all_closed() -> None:
    client = CountingClient()
    results = asyncio.run(collect_all(client.generate, specs(500), True, 1))
    assert [r[0].text for r in results] == [str(i) for i in range(500)]
    assert client.most_open == MAX_CALLS_IN_FLIGHT
    assert len(client.calls) == 500 and all(c.cancelled for c in client.calls)
    assert client.open == 0


def test_a_failure_closes_the_open_calls_and_starts_no_more() -> None:
    client = CountingClient(fail_at=100)
    with pytest.raises(ApiError) as caught:
        asyncio.run(collect_all(client.generate, specs(500), True, 1))
    assert caught.value.status == 429
    assert len(client.calls) < 100 + 2 * MAX_CALLS_IN_FLIGHT    # the rest never started
    assert all(c.cancelled for c in client.calls) and client.open == 0


class StreamingClient(FakeClient):
    """Streams each prompt's `n` choices, choice c's text "[request id/c]" in two chunks a
    little apart, counting the calls open (not yet cancelled) at once; the call of the
    `fail_at`-th prompt fails before its first chunk."""

    def __init__(self, n: int = 1, fail_at: int | None = None) -> None:
        super().__init__()
        self.n, self.fail_at = n, fail_at
        self.open = self.most_open = 0

    def generate(self, spec: GenerateSpec, whole: bool = False) -> FakeCall:
        failing = len(self.specs) == self.fail_at
        self.specs.append(spec)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        rid = spec.request_id
        chunks = [Chunk((1,), f"[{rid}/{c}", (), index=c) for c in range(self.n)]
        chunks += [Chunk((2,), "]", (), "length", None, Usage(1, 2, 0), index=c)
                   for c in range(self.n)]
        return tracked(self, FakeCall([] if failing else chunks,
                                      ApiError(400, "prompt is too long") if failing else None,
                                      0.002))


def stream(client: StreamingClient, body: Any,
           stop_after: int | None = None) -> list[dict[str, Any]]:
    """The stream's events (without [DONE], which must end it); with `stop_after`, the task
    reading them is cancelled after that many (as Starlette does when the client goes), and
    nothing may open a call afterwards."""
    async def run() -> list[bytes]:
        serving = OpenAIServing(client, Ready(), HttpConfig(max_prompts_per_request=1000))  # type: ignore[arg-type]
        response = await serving.completions(body)
        assert isinstance(response, EventStream)
        events: list[bytes] = []
        enough = asyncio.Event()

        async def read_all() -> None:
            async for event in response.events:
                events.append(event)
                if len(events) == stop_after:
                    enough.set()
        reader = asyncio.ensure_future(read_all())
        if stop_after is None:
            await reader
            return events
        await enough.wait()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        num_opened = len(client.calls)
        await asyncio.sleep(0.05)
        assert len(client.calls) == num_opened
        return events
    events = asyncio.run(run())
    if stop_after is None:
        assert events[-1] == DONE
        events = events[:-1]
    return [json.loads(e[6:]) for e in events]


def texts_by_choice(events: list[dict[str, Any]]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


@pytest.mark.parametrize("n", [1, 3])
def test_a_streamed_batch_opens_a_bounded_number_of_calls_and_keeps_every_index(n: int,
                                                                                  ) -> None:
    client = StreamingClient(n)
    num_prompts = 4 * MAX_CALLS_IN_FLIGHT + 3
    events = stream(client, completion(prompt=[f"p{i}" for i in range(num_prompts)], n=n,
                                       stream=True, stream_options={"include_usage": True}))
    assert client.most_open == MAX_CALLS_IN_FLIGHT
    assert len(client.calls) == num_prompts and client.open == 0
    response_id = events[0]["id"]
    assert texts_by_choice(events) == {i * n + c: f"[{response_id}-{i}/{c}]"
                                       for i in range(num_prompts) for c in range(n)}
    finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finished) == list(range(num_prompts * n))
    assert events[-1]["usage"]["completion_tokens"] == 2 * num_prompts * n


def test_a_later_prompts_failure_is_an_error_event_and_closes_every_call() -> None:
    client = StreamingClient(fail_at=2 * MAX_CALLS_IN_FLIGHT)
    events = stream(client, completion(prompt=["p"] * (8 * MAX_CALLS_IN_FLIGHT), stream=True))
    assert events[-1]["error"]["message"] == "prompt is too long"
    assert len(client.calls) < 3 * MAX_CALLS_IN_FLIGHT + 1    # the rest never opened
    assert all(c.cancelled for c in client.calls) and client.open == 0


def test_a_first_prompts_failure_is_still_an_http_error() -> None:
    client = StreamingClient(fail_at=MAX_CALLS_IN_FLIGHT - 1)
    with pytest.raises(ApiError) as caught:
        stream(client, completion(prompt=["p"] * (4 * MAX_CALLS_IN_FLIGHT), stream=True))
    assert caught.value.status == 400
    assert len(client.calls) == MAX_CALLS_IN_FLIGHT and client.open == 0


def test_a_client_gone_mid_stream_closes_every_call_and_opens_no_more() -> None:
    client = StreamingClient()
    stream(client, completion(prompt=["p"] * (8 * MAX_CALLS_IN_FLIGHT), stream=True),
           stop_after=3 * MAX_CALLS_IN_FLIGHT)
    num_opened = len(client.calls)
    assert num_opened < 8 * MAX_CALLS_IN_FLIGHT
    assert all(c.cancelled for c in client.calls) and client.open == 0
