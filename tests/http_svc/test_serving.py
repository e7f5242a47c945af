"""The endpoints' logic between a parsed body and a response body, against a stand-in for
the scheduler client (no network): what each request sends to the scheduler (prompt form,
request ids, max_tokens for "the rest of the context"), the checks that come first (404,
503, sizes), and the responses assembled from the chunks."""

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from http_svc.errors import ApiError
from http_svc.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
)
from http_svc.scheduler_client import Chunk, GenerateSpec, ModelCard, Prompt, Usage
from http_svc.serving import OpenAIServing
from tests.http_svc.test_streaming import FakeCall

CARD = ModelCard(name="smol", max_model_len=100, vocab_size=50, max_prompt_bytes=1000)


class FakeClient:
    """Answers like the scheduler: every prompt tokenizes to one id per character, every
    generation is "ok" in two chunks (streamed) or one (asked for whole: GenerateOnce)."""

    def __init__(self, kv_capacity: int | None = None) -> None:
        self.specs: list[GenerateSpec] = []
        self.wholes: list[bool] = []
        self.calls: list[FakeCall] = []
        self.tokenized: list[tuple[Prompt, bool]] = []
        self.capacity = kv_capacity

    async def model_card(self) -> ModelCard:
        return CARD

    async def kv_capacity(self) -> int | None:
        return self.capacity

    async def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True,
                       ) -> tuple[list[int], str]:
        self.tokenized.append((prompt, add_generation_prompt))
        if prompt.chat is None:
            return [1] * len(prompt.text or ""), prompt.text or ""
        text = "".join(c for _, c in prompt.chat)
        return [1] * (len(text) + (2 if add_generation_prompt else 0)), text

    async def detokenize(self, sequences: Sequence[Sequence[int]],
                         skip_special_tokens: bool = False) -> list[str]:
        return ["x" * len(s) for s in sequences]

    async def vocabulary(self) -> list[str]:
        return [f"t{i}" for i in range(CARD.vocab_size)]

    def generate(self, spec: GenerateSpec, whole: bool = False) -> FakeCall:
        self.specs.append(spec)
        self.wholes.append(whole)
        prompt = spec.prompt
        num_prompt = len(prompt.token_ids or prompt.text
                         or "".join(c for _, c in prompt.chat or ()))
        usage = Usage(num_prompt, 2, 0)
        call = FakeCall([Chunk((1, 2), "ok", (), "stop", None, usage)] if whole else
                        [Chunk((1,), "o", ()), Chunk((2,), "k", (), "stop", None, usage)])
        self.calls.append(call)
        return call


class Ready:
    def __init__(self, ready: bool = True) -> None:
        self.ready = ready
        self.why_not = "no worker"


def serve(method: str, body: Any, client: FakeClient | None = None,
          ready: bool = True) -> tuple[Any, FakeClient]:
    client = client or FakeClient()
    serving = OpenAIServing(client, Ready(ready))  # type: ignore[arg-type]
    return asyncio.run(getattr(serving, method)(body)), client


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hello"}], **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hello", **fields})


def test_a_chat_with_a_limit_goes_as_messages() -> None:
    response, client = serve("chat", chat(max_tokens=5))
    (spec,) = client.specs
    assert spec.prompt == Prompt(chat=(("user", "hello"),)) and spec.sampling.max_tokens == 5
    assert spec.request_id == response["id"] and response["id"].startswith("chatcmpl-")
    assert response["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                            "content": "ok"},
                                    "logprobs": None, "finish_reason": "stop",
                                    "stop_reason": None}]
    assert response["usage"]["total_tokens"] == 5 + 2
    assert client.calls[0].cancelled        # the call is closed once collected


@pytest.mark.parametrize("method, body", [
    ("chat", chat(max_tokens=5)), ("completions", completion(prompt=["a", "b"], max_tokens=5))])
def test_a_reply_without_a_stream_asks_for_each_completion_whole(method: str,
                                                                 body: Any) -> None:
    """One choice and no stream: GenerateOnce (no message per token on the way; n > 1 takes
    the stream, where the choices come interleaved: test_choices_and_penalties.py)."""
    response, client = serve(method, body)
    assert client.wholes == [True] * len(client.specs) and client.specs
    assert [c.get("text", c.get("message", {}).get("content")) for c in response["choices"]] \
        == ["ok"] * len(client.specs)


def test_a_streamed_reply_streams() -> None:
    for method, body in (("chat", chat(max_tokens=5, stream=True)),
                         ("completions", completion(max_tokens=5, stream=True))):
        response, client = serve(method, body)
        assert client.wholes == [False]


def test_without_a_limit_the_rest_of_the_context_after_the_tokenized_prompt() -> None:
    _, client = serve("chat", chat())
    (spec,) = client.specs
    assert spec.prompt.token_ids == (1,) * 7                       # "hello" + the header
    assert spec.sampling.max_tokens == CARD.max_model_len - 7
    # A replica that holds less than a context bounds it (vLLM's always holds one).
    _, client = serve("chat", chat(), FakeClient(kv_capacity=40))
    assert client.specs[0].sampling.max_tokens == 40 - 7
    _, client = serve("completions", completion(max_tokens=None))
    assert client.specs[0].prompt.token_ids == (1,) * 5
    assert client.specs[0].sampling.max_tokens == CARD.max_model_len - 5


def test_without_the_assistant_header_the_reply_continues_the_last_role() -> None:
    response, client = serve("chat", chat(max_tokens=3, add_generation_prompt=False))
    assert client.tokenized == [(Prompt(chat=(("user", "hello"),)), False)]
    assert client.specs[0].prompt.token_ids == (1,) * 5
    assert client.specs[0].sampling.max_tokens == 3
    assert response["choices"][0]["message"]["role"] == "user"


def test_a_batch_of_prompts_is_one_request_each() -> None:
    response, client = serve("completions", completion(prompt=["ab", "cde"]))
    assert [s.prompt.text for s in client.specs] == ["ab", "cde"]
    assert [s.request_id for s in client.specs] == [f"{response['id']}-0", f"{response['id']}-1"]
    assert all(s.sampling.max_tokens == 16 for s in client.specs)    # OpenAI's default
    assert [(c["index"], c["text"]) for c in response["choices"]] == [(0, "ok"), (1, "ok")]
    assert response["usage"] == {"prompt_tokens": 5, "completion_tokens": 4,
                                 "total_tokens": 9, "prompt_tokens_details": {
                                     "cached_tokens": 0}}
    _, client = serve("completions", completion(prompt=[[1, 2], [3]]))
    assert [s.prompt.token_ids for s in client.specs] == [(1, 2), (3,)]


def test_logprobs_use_the_vocabulary() -> None:
    response, client = serve("completions", completion(logprobs=0))
    assert response["choices"][0]["logprobs"]["tokens"] == []   # the fake sends none
    # Every token's alternatives in one reply could pass gRPC's message bound: streamed.
    assert client.wholes == [False]
    _, client = serve("chat", chat(max_tokens=5, logprobs=True, top_logprobs=2))
    assert client.wholes == [False]


@pytest.mark.parametrize("method, body, status, param", [
    ("chat", chat(model="other"), 404, "model"),
    ("completions", completion(prompt="x" * 1001), 400, "prompt"),
    ("completions", completion(prompt=["a", "x" * 1001]), 400, "prompt[1]"),
    ("completions", completion(prompt=[1] * 100), 400, "prompt"),
    ("completions", completion(prompt=[]), 400, "prompt"),
    ("chat", chat(messages=[{"role": "user", "content": "y" * 1001}]), 400, "messages"),
    ("detokenize", DetokenizeRequest(tokens=[1, 50]), 400, "tokens"),
])
def test_refusals_before_anything_is_sent(method: str, body: Any, status: int,
                                          param: str) -> None:
    client = FakeClient()
    with pytest.raises(ApiError) as refused:
        serve(method, body, client)
    assert (refused.value.status, refused.value.param) == (status, param)
    assert not client.specs and not client.tokenized


def test_no_ready_replica_is_503_after_the_checks_of_the_request() -> None:
    with pytest.raises(ApiError) as refused:
        serve("completions", completion(), ready=False)
    assert refused.value.status == 503 and refused.value.message.endswith(": no worker")
    with pytest.raises(ApiError) as refused:             # a bad request is still a 400
        serve("completions", completion(n=0), ready=False)
    assert refused.value.status == 400


def test_tokenize_and_detokenize() -> None:
    tokens, client = serve("tokenize", TokenizeChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}))
    assert tokens == {"count": 2, "max_model_len": 100, "tokens": [1, 1], "token_strs": None}
    assert client.tokenized == [(Prompt(chat=(("user", "hi"),)), False)]
    assert serve("detokenize", DetokenizeRequest(tokens=[1, 2, 3]))[0] == {"prompt": "xxx"}
