"""n, echo, the penalties, min_p and logit_bias through the HTTP layer, without a network:
their mapping (ranges, clamping, the gRPC fields they fill) and the responses built from a
stream that carries several choices."""

import asyncio
import json
from typing import Any

import pytest

from http_svc.errors import ApiError
from http_svc.protocol import ChatCompletionRequest, CompletionRequest
from http_svc.sampling import chat_sampling, completion_sampling
from http_svc.scheduler_client import (
    Chunk,
    GenerateSpec,
    Prompt,
    TokenLogprob,
    Usage,
    spec_to_pb,
)
from http_svc.serving import OpenAIServing
from tests.http_svc.test_serving import FakeClient, Ready
from tests.http_svc.test_streaming import FakeCall

USER = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def test_penalties_and_bias_map_onto_the_grpc_fields() -> None:
    s = completion_sampling(completion(min_p=0.05, presence_penalty=0.5, frequency_penalty=-1,
                                       repetition_penalty=1.3, n=3,
                                       logit_bias={"42": 150, "7": -3.5, "0": -1000}))
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.n) == (
        0.05, 0.5, -1.0, 1.3, 3)
    assert s.logit_bias == ((0, -100.0), (7, -3.5), (42, 100.0))   # clamped, as vLLM
    pb = spec_to_pb(GenerateSpec("r", Prompt(text="x"), s)).sampling
    assert pb.n == 3 and pb.repetition_penalty == pytest.approx(1.3)
    assert pb.min_p == pytest.approx(0.05) and pb.frequency_penalty == -1.0
    assert dict(pb.logit_bias) == {0: -100.0, 7: -3.5, 42: 100.0}
    neutral = spec_to_pb(GenerateSpec("r", Prompt(text="x"),
                                      chat_sampling(chat(max_completion_tokens=5)))).sampling
    for name in ("n", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert not neutral.HasField(name), name
    assert not neutral.logit_bias and neutral.max_tokens == 5


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"logit_bias": {str(i): 0.0 for i in range(1025)}}, "logit_bias"),
    ({"n": 65}, "n"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
])
def test_bad_values_are_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    for make in (lambda: completion_sampling(completion(**fields)),
                 lambda: chat_sampling(chat(**fields))):
        with pytest.raises(ApiError) as refused:
            make()
        assert (refused.value.status, refused.value.param) == (400, param)


PROMPT_LP = TokenLogprob(1, -0.5, ((2, -0.1), (1, -0.5)), rank=2)


class ChoicesClient(FakeClient):
    """Every generation is "ok" for each of its n choices, the choices' chunks interleaved;
    with prompt logprobs, choice 0's first chunk has PROMPT_LP for each prompt token but the
    first (text prompts tokenize to one token per character)."""

    def generate(self, spec: GenerateSpec, whole: bool = False) -> FakeCall:
        assert not whole or spec.sampling.n == 1    # GenerateOnce takes one choice only
        self.specs.append(spec)
        self.wholes.append(whole)
        n = spec.sampling.n
        prompt = spec.prompt.token_ids or spec.prompt.text or ""
        prompt_lps = ((PROMPT_LP,) * (len(prompt) - 1)
                      if spec.sampling.prompt_logprobs is not None else ())
        lp = TokenLogprob(7, -1.0, ((7, -1.0),)) if spec.sampling.logprobs is not None else None
        chunks = [Chunk((1,), f"o{j}", (lp,) if lp else (), index=j,
                        prompt_logprobs=prompt_lps if j == 0 else ()) for j in range(n)]
        chunks += [Chunk((2,), "k", (), "stop", None, Usage(5, 2, 4 if j else 0), index=j)
                   for j in reversed(range(n))]
        call = FakeCall(chunks)
        self.calls.append(call)
        return call


def serve(method: str, body: Any) -> tuple[Any, ChoicesClient]:
    client = ChoicesClient()
    serving = OpenAIServing(client, Ready())  # type: ignore[arg-type]

    async def run() -> Any:
        result = await getattr(serving, method)(body)
        if hasattr(result, "events"):
            return [event async for event in result.events]
        return result

    return asyncio.run(run()), client


def events_json(events: list[bytes]) -> list[dict[str, Any]]:
    assert events[-1] == b"data: [DONE]\n\n"
    return [json.loads(e[len(b"data: "):]) for e in events[:-1]]


def test_n_choices_come_from_one_request_and_count_the_prompt_once() -> None:
    body, client = serve("completions", completion(prompt=["ab", "cd"], n=2, max_tokens=4))
    assert [s.sampling.n for s in client.specs] == [2, 2]           # one call per prompt
    assert client.wholes == [False, False]          # n > 1: streamed (choices interleave)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "o0k"), (1, "o1k"), (2, "o0k"), (3, "o1k")]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    chat_body, _ = serve("chat", chat(n=3, max_completion_tokens=4))
    assert [(c["index"], c["message"]["content"]) for c in chat_body["choices"]] == [
        (0, "o0k"), (1, "o1k"), (2, "o2k")]


def test_streamed_choices_are_numbered_per_prompt_and_choice() -> None:
    events, _ = serve("completions", completion(prompt=["ab", "cd"], n=2, max_tokens=4,
                                                stream=True,
                                                stream_options={"include_usage": True}))
    chunks = events_json(events)
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "o0k", 1: "o1k", 2: "o0k", 3: "o1k"}
    assert chunks[-1]["usage"]["prompt_tokens"] == 10
    events, _ = serve("chat", chat(n=2, max_completion_tokens=4, stream=True))
    chunks = events_json(events)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}] * 2
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}


def test_echo_starts_each_choice_with_the_prompt() -> None:
    body, _ = serve("completions", completion(prompt=["ab", "c"], echo=True, n=2, max_tokens=4))
    assert [c["text"] for c in body["choices"]] == ["abo0k", "abo1k", "co0k", "co1k"]
    body, _ = serve("completions", completion(prompt=[[1, 2], [3, 4, 5]], echo=True,
                                              max_tokens=4))
    assert [c["text"] for c in body["choices"]] == ["xxo0k", "xxxo0k"]   # ids decoded
    events, _ = serve("completions", completion(prompt="ab", echo=True, max_tokens=4,
                                                stream=True))
    assert events_json(events)[0]["choices"][0]["text"] == "abo0"
    body, client = serve("completions", completion(prompt="abc", echo=True, logprobs=1,
                                                   max_tokens=4, n=2))
    assert client.specs[0].sampling.prompt_logprobs == 1          # echo asks for them
    for choice in body["choices"]:
        lps = choice["logprobs"]
        assert lps["tokens"] == ["t1", "t1", "t1", "t7"]            # prompt, then the reply
        assert lps["token_logprobs"] == [None, -0.5, -0.5, -1.0]
        assert lps["top_logprobs"][0] is None and lps["top_logprobs"][1] == {"t1": -0.5,
                                                                             "t2": -0.1}
        assert lps["text_offset"] == [0, 2, 4, 6]
    events, _ = serve("completions", completion(prompt="abc", echo=True, logprobs=0,
                                                max_tokens=4, stream=True))
    first = events_json(events)[0]["choices"][0]
    assert first["text"] == "abco0" and first["logprobs"]["token_logprobs"] == [None, -0.5,
                                                                               -0.5, -1.0]
    # Chat: the last message's content, where it has the reply's role.
    last_assistant = [*USER, {"role": "assistant", "content": "Sure: "}]
    body, _ = serve("chat", ChatCompletionRequest.model_validate(
        {"messages": last_assistant, "echo": True, "add_generation_prompt": False,
         "max_completion_tokens": 4}))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Sure: o0k"}
    body, _ = serve("chat", chat(echo=True, max_completion_tokens=4))
    assert body["choices"][0]["message"]["content"] == "o0k"      # the last one is the user's


def test_prompt_logprobs_in_vllms_shape() -> None:
    body, client = serve("completions", completion(prompt="abc", prompt_logprobs=1,
                                                   max_tokens=4))
    assert client.specs[0].sampling.prompt_logprobs == 1
    entry = {"1": {"logprob": -0.5, "rank": 2, "decoded_token": "t1"},
             "2": {"logprob": -0.1, "rank": 1, "decoded_token": "t2"}}
    assert body["choices"][0]["prompt_logprobs"] == [None, entry, entry]
    assert body["choices"][0]["logprobs"] is None
    chat_body, _ = serve("chat", chat(prompt_logprobs=0))     # tokenized: 4 tokens
    assert chat_body["prompt_logprobs"] == [None] + [{"1": {"logprob": -0.5, "rank": 2,
                                                            "decoded_token": "t1"}}] * 3
    assert chat_body["choices"][0]["logprobs"] is None
    for fields in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
        with pytest.raises(ApiError) as refused:
            completion_sampling(completion(**fields))
        assert refused.value.param == "prompt_logprobs"
