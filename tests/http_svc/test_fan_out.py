"""Bounded fan-out (issue 40): a completions request's prompts times `n`, and chat's `n`, are
capped by --max-prompts-per-request with a 400 naming the field before anything reaches the
scheduler; the calls of an admitted request are opened at most MAX_CALLS_IN_FLIGHT at a
time, all closed once read, and a failure closes the open ones and starts no more."""

import asyncio
from typing import Any

import pytest

from http_svc.config import HttpConfig
from http_svc.errors import ApiError
from http_svc.outputs import MAX_CALLS_IN_FLIGHT, collect_all
from http_svc.scheduler_client import Chunk, GenerateSpec, Prompt, Usage
from http_svc.serving import OpenAIServing
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
        call = FakeCall(chunks[:1] if error else chunks, error, delay_s=0.001)
        original = call.cancel

        def cancel() -> None:
            if not call.cancelled:
                self.open -= 1
            original()
        call.cancel = cancel  # type: ignore[method-assign]
        self.calls.append(call)
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
