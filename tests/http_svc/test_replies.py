"""A chat choice's text read into reasoning, content and tool calls (http_svc.replies),
whole and streamed: the streamed deltas add up to the whole reply, forced calls (required,
named) come out of the grammar's JSON, and a plain reply is its text."""

import json
import random

import pytest

from http_svc.reasoning import REASONING_PARSERS
from http_svc.replies import Reply, ReplyReader, merge
from http_svc.structured import Structured
from http_svc.tool_parsers import HermesParser
from http_svc.tools import ToolPlan

AUTO = ToolPlan("auto", parser=HermesParser())
REQUIRED = ToolPlan("required", structured=Structured("tool_choice", json_schema="{}"))
NAMED = ToolPlan("named", function="weather",
                 structured=Structured("tool_choice", json_schema="{}"))
THINKING = '<think>Which city?</think>Let me look. <tool_call>{"name": "weather", ' \
           '"arguments": {"city": "Paris"}}</tool_call>'


def streamed(reader: ReplyReader, text: str, step: int) -> dict:
    delta: dict = {}
    for i in range(0, len(text), step):
        delta = merge(delta, reader.feed(text[i:i + step]))
    return merge(delta, reader.finish())


def test_a_plain_reply_is_its_text() -> None:
    assert ReplyReader().read("Hello <tool_call>").message("assistant") == {
        "role": "assistant", "content": "Hello <tool_call>"}
    assert ReplyReader().feed("He") == {"content": "He"} and ReplyReader().feed("") == {}


def test_reasoning_content_and_calls_whole() -> None:
    reader = ReplyReader(AUTO, REASONING_PARSERS["deepseek_r1"])
    reply = reader.read(THINKING)
    assert (reply.reasoning, reply.content) == ("Which city?", "Let me look. ")
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("weather", {"city": "Paris"})]
    message = reply.message("assistant")
    assert message["tool_calls"][0]["type"] == "function" and reader.made_calls
    assert message["reasoning_content"] == "Which city?"
    # Calls and nothing else: content null, as OpenAI answers.
    only = ReplyReader(AUTO).read('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert only.content is None and len(only.calls) == 1


@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_add_up_to_the_whole_reply(seed: int) -> None:
    """In random chunks of 1..8 characters: reasoning, then content, then the call (its
    head once, then its arguments as they come); the same reply as when read whole."""
    text = THINKING + '<tool_call>{"name": "time", "arguments": {"tz": "CET"}}</tool_call>'
    rng = random.Random(seed)
    reader, deltas, at = ReplyReader(AUTO, REASONING_PARSERS["deepseek_r1"]), [], 0
    while at < len(text):
        size = rng.randint(1, 8)
        deltas.append(reader.feed(text[at:at + size]))
        at += size
    deltas.append(reader.finish())
    whole = ReplyReader(AUTO, REASONING_PARSERS["deepseek_r1"]).read(text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.reasoning
    assert "".join(d.get("content", "") for d in deltas) == whole.content
    entries = [c for d in deltas for c in d.get("tool_calls", ())]
    heads = [c for c in entries if "id" in c]
    assert [(c["index"], c["function"]) for c in heads] == [
        (0, {"name": "weather", "arguments": ""}), (1, {"name": "time", "arguments": ""})]
    arguments = ["".join(c["function"]["arguments"] for c in entries if c["index"] == i)
                 for i in (0, 1)]
    assert [json.loads(a) for a in arguments] == [json.loads(c.arguments) for c in whole.calls]
    assert entries.index(heads[1]) > max(i for i, c in enumerate(entries) if c["index"] == 0)
    assert [c["id"] for c in heads] == [c.id for c in reader.calls] and reader.made_calls
    assert len(entries) > 4        # the arguments came in pieces, not whole at the end
    assert "tool_calls" not in deltas[-1] or len(deltas[-1]["tool_calls"]) < len(entries)


def test_required_reads_the_forced_array() -> None:
    text = '[{"name": "weather", "parameters": {"city": "Rome"}}, {"name": "time", ' \
           '"parameters": {}}]'
    reader = ReplyReader(REQUIRED, REASONING_PARSERS["qwen3"])
    assert reader.feed(text[:10]) == {}             # nothing until the array is whole
    delta = merge(reader.feed(text[10:]), reader.finish())
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["weather", "time"]
    assert [c["index"] for c in delta["tool_calls"]] == [0, 1] and reader.made_calls
    cut = ReplyReader(REQUIRED).read('[{"name": "wea')       # cut by the length limit
    assert cut == Reply('[{"name": "wea', None, [])


def test_a_named_call_streams_its_arguments() -> None:
    reader = ReplyReader(NAMED)
    first = reader.feed('{"city": ')
    (opened,) = first["tool_calls"]
    assert opened["function"] == {"name": "weather", "arguments": '{"city": '}
    assert opened["id"].startswith("call_") and opened["index"] == 0
    assert reader.feed('"Oslo"}') == {"tool_calls": [{"index": 0, "function": {
        "arguments": '"Oslo"}'}}]}
    assert reader.finish() == {}
    assert reader.calls[0].arguments == '{"city": "Oslo"}' and reader.calls[0].id == opened["id"]
    whole = ReplyReader(NAMED).read('{"city": "Oslo"}')
    assert whole.content is None and whole.calls[0].arguments == '{"city": "Oslo"}'
