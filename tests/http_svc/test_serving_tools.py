"""Chat completions with tools, reasoning and continuous usage, end to end inside the front
end (a stand-in scheduler client whose replies are scripted): what reaches the scheduler (the
forcing grammar, special tokens kept for a parser's markers, token ids when usage is counted
on every chunk), and the replies: tool_calls with finish_reason "tool_calls", streamed as
deltas, reasoning_content, vLLM's continuous usage, /tokenizer_info."""

import asyncio
import json
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from http_svc.config import HttpConfig
from http_svc.errors import ApiError
from http_svc.protocol import ChatCompletionRequest, CompletionRequest
from http_svc.scheduler_client import Chunk, GenerateSpec, Usage
from http_svc.serving import OpenAIServing
from tests.http_svc.test_serving import CARD, FakeClient, Ready
from tests.http_svc.test_streaming import FakeCall

WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object",
                                      "properties": {"city": {"type": "string"}}}}}
HERMES = '<think>hmm</think>Checking. <tool_call>{"name": "weather", "arguments": ' \
         '{"city": "Paris"}}</tool_call>'
CONFIG = HttpConfig(tool_call_parser="hermes", enable_auto_tool_choice=True,
                    reasoning_parser="deepseek_r1")


class ScriptedClient(FakeClient):
    """Replies `text` (two characters per chunk, one token each; one chunk when whole)."""

    def __init__(self, text: str, finish: str = "stop") -> None:
        super().__init__()
        self.text, self.finish = text, finish

    def generate(self, spec: GenerateSpec, whole: bool = False) -> FakeCall:
        self.specs.append(spec)
        self.wholes.append(whole)
        pieces = [self.text] if whole else [self.text[i:i + 2]
                                            for i in range(0, len(self.text), 2)]
        usage = Usage(7, len(pieces), 0)
        chunks = [Chunk((i,), p, ()) for i, p in enumerate(pieces[:-1])]
        chunks.append(Chunk((9,), pieces[-1], (), self.finish, None, usage))
        call = FakeCall(chunks)
        self.calls.append(call)
        return call


def run(client: FakeClient, method: str, body: Any, config: HttpConfig = CONFIG) -> Any:
    serving = OpenAIServing(client, Ready(), config)  # type: ignore[arg-type]

    async def go() -> Any:
        result = await getattr(serving, method)(*([body] if body is not None else []))
        if hasattr(result, "events"):
            events = [e async for e in result.events]
            assert events[-1] == b"data: [DONE]\n\n"
            return [json.loads(e[len(b"data: "):]) for e in events[:-1]]
        return result

    return asyncio.run(go())


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 50,
         **fields})


def test_auto_tool_calls_with_reasoning() -> None:
    client = ScriptedClient(HERMES)
    response = run(client, "chat", chat(tools=[WEATHER]))
    (choice,) = response["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert (message["content"], message["reasoning_content"]) == ("Checking. ", "hmm")
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert client.specs[0].sampling.structured is None          # auto: nothing forced
    assert client.specs[0].sampling.keep_special_tokens is False   # <tool_call> is text


def test_auto_tool_calls_streamed() -> None:
    events = run(ScriptedClient(HERMES), "chat", chat(tools=[WEATHER], stream=True))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert "".join(d.get("content", "") for d in deltas) == "Checking. "
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    # The call's head once, then its arguments as they come (two characters a chunk).
    assert calls[0]["function"] == {"name": "weather", "arguments": ""}
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert all(set(c) == {"index", "function"} and c["index"] == 0 for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert len(calls) > 3 and "tool_calls" not in deltas[-1]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("<tool" not in d.get("content", "") for d in deltas)


def test_a_reply_without_calls_stops_as_usual() -> None:
    config = HttpConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    response = run(ScriptedClient("Sunny, I think."), "chat", chat(tools=[WEATHER]), config)
    (choice,) = response["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "Sunny, I think."
    # deepseek_r1: a reply that never left its thinking is all reasoning.
    message = run(ScriptedClient("Sunny, I think."), "chat", chat(tools=[WEATHER]))[
        "choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("", "Sunny, I think.")


def test_forced_calls_go_through_the_grammar() -> None:
    client = ScriptedClient('[{"name": "weather", "parameters": {"city": "Oslo"}}]')
    response = run(client, "chat", chat(tools=[WEATHER], tool_choice="required"),
                   HttpConfig())
    structured = client.specs[0].sampling.structured
    assert structured is not None and structured.param == "tool_choice"
    assert json.loads(structured.json_schema or "")["type"] == "array"
    (choice,) = response["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "weather", "arguments": '{"city": "Oslo"}'}
    named = {"type": "function", "function": {"name": "weather"}}
    events = run(ScriptedClient('{"city": "Oslo"}'), "chat",
                 chat(tools=[WEATHER], tool_choice=named, stream=True), HttpConfig())
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", ())]
    assert calls[0]["function"]["name"] == "weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_forced_call_cut_short_is_content_with_length() -> None:
    response = run(ScriptedClient('[{"name": "wea', "length"), "chat",
                   chat(tools=[WEATHER], tool_choice="required"), HttpConfig())
    (choice,) = response["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == '[{"name": "wea'


def test_a_forced_call_and_a_response_format_conflict() -> None:
    with pytest.raises(ApiError) as refused:
        run(ScriptedClient("x"), "chat", chat(tools=[WEATHER], tool_choice="required",
                                              response_format={"type": "json_object"}))
    assert refused.value.param == "tool_choice"


def test_a_parser_with_special_token_markers_keeps_them() -> None:
    client = ScriptedClient('[TOOL_CALLS] [{"name": "weather", "arguments": {}}]')
    config = HttpConfig(tool_call_parser="mistral", enable_auto_tool_choice=True)
    response = run(client, "chat", chat(tools=[WEATHER]), config)
    assert client.specs[0].sampling.keep_special_tokens is True
    assert response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "weather"
    # Without tools the reply is not read for calls, and special tokens stay out.
    client = ScriptedClient("[TOOL_CALLS] [] ")
    assert run(client, "chat", chat(), config)["choices"][0]["message"]["content"] \
        == "[TOOL_CALLS] [] "
    assert client.specs[0].sampling.keep_special_tokens is False


@pytest.mark.parametrize("method, body", [
    ("chat", chat(stream=True, stream_options={"include_usage": True,
                                               "continuous_usage_stats": True})),
    ("completions", CompletionRequest.model_validate({
        "prompt": "hello", "stream": True, "max_tokens": 5,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})),
])
def test_continuous_usage_counts_every_chunk(method: str, body: Any) -> None:
    client = ScriptedClient("abcdef")
    events = run(client, method, body, HttpConfig())
    prompt_tokens = len(client.specs[0].prompt.token_ids or ())
    assert prompt_tokens > 0           # tokenized first, so the prompt can be counted
    with_choices = [e for e in events if e["choices"]]
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and counts[-1] == 3
    assert all(e["usage"]["prompt_tokens"] == prompt_tokens for e in with_choices)
    assert all(e["usage"]["total_tokens"] == prompt_tokens + e["usage"]["completion_tokens"]
               for e in with_choices)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    # include_usage alone: usage only at the end.
    body = body.model_copy(update={"stream_options": body.stream_options.model_copy(
        update={"continuous_usage_stats": False})})
    events = run(ScriptedClient("abcdef"), method, body, HttpConfig())
    assert all("usage" not in e for e in events[:-1]) and "usage" in events[-1]


def test_tokenizer_info() -> None:
    class EosClient(FakeClient):
        async def model_card(self):  # type: ignore[no-untyped-def]
            return CARD.__class__(CARD.name, CARD.max_model_len, CARD.vocab_size,
                                  CARD.max_prompt_bytes, (2, 5))

    info = run(EosClient(), "tokenizer_info", None)
    assert info["eos_token_ids"] == [2, 5] and info["eos_token_id"] == 2
    assert info["eos_token"] == "x" and info["model_max_length"] == CARD.max_model_len


TWO_CALLS = {
    "hermes": 'Checking. <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}'
              '</tool_call>\n<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}'
              "</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "weather", "parameters": {"city": "Rome"}}<|eot_id|>',
    "mistral": '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}, '
               '{"name": "weather", "arguments": {"city": "Rome"}}]</s>',
}


@pytest.mark.parametrize("parser", sorted(TWO_CALLS))
def test_parallel_auto_calls_stream_as_the_whole_reply_reads(parser: str) -> None:
    config = HttpConfig(tool_call_parser=parser, enable_auto_tool_choice=True)
    text = TWO_CALLS[parser]
    whole = run(ScriptedClient(text), "chat", chat(tools=[WEATHER]), config)["choices"][0]
    events = run(ScriptedClient(text), "chat", chat(tools=[WEATHER], stream=True), config)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == (whole["message"]["content"]
                                                               or "")
    entries = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [(c["index"], c["function"]["name"]) for c in entries if "id" in c] == [
        (0, "weather"), (1, "weather")]
    streamed = [json.loads("".join(c["function"]["arguments"] for c in entries
                                   if c["index"] == i)) for i in (0, 1)]
    assert streamed == [json.loads(c["function"]["arguments"])
                        for c in whole["message"]["tool_calls"]]
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "tool_calls"
    # The openai client adds the deltas up to the message a whole reply has.
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    (added,) = state.get_final_completion().choices
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in added.message.tool_calls or ()] == [("weather", {"city": "Paris"}),
                                                         ("weather", {"city": "Rome"})]
    assert added.finish_reason == "tool_calls"


def test_a_streamed_call_that_does_not_parse_ends_as_content() -> None:
    """Cut off by the length limit after its arguments: the call had opened, then the text
    from where it began comes as content, and the finish reason is the model's."""
    text = 'Checking. <tool_call>{"name": "weather", "arguments": {"city": "Paris"}'
    config = HttpConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    events = run(ScriptedClient(text, "length"), "chat", chat(tools=[WEATHER], stream=True),
                 config)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    whole = run(ScriptedClient(text, "length"), "chat", chat(tools=[WEATHER]), config)
    assert whole["choices"][0]["message"]["content"] == text
