"""A streamed reply read for tool calls (http_svc.tool_stream), in each format and in random
chunkings: content and calls add up to what the whole reply parses to, a call's head goes out
once and then its arguments as they come (exactly the text the model wrote), parallel calls
count up, a call that does not parse ends as content, and no half marker is sent as content."""

import json
import random

import pytest

from http_svc.tool_parsers import (
    TOOL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    ToolParser,
)
from http_svc.tool_stream import ToolCallStream


def streamed(parser: ToolParser, text: str, seed: int | None = None, step: int = 0
             ) -> tuple[str, list[dict], list[ToolCall]]:
    """`text` fed in chunks of `step` characters, or of 1..8 at random: the content sent,
    the tool_calls deltas sent, and the calls at the end."""
    rng = random.Random(seed)
    stream = ToolCallStream(parser)
    content, deltas, at = "", [], 0
    while at < len(text):
        size = step or rng.randint(1, 8)
        sent, calls = stream.feed(text[at:at + size])
        content, deltas, at = content + sent, deltas + calls, at + size
    rest, more, calls = stream.finish()
    return content + rest, deltas + more, calls


def assembled(deltas: list[dict]) -> list[dict]:
    """The calls the deltas add up to, as a client adds them up; each call's name, id and
    type come once, in its first delta (arguments "" unless the call came whole), and
    indices count up from 0."""
    calls: list[dict] = []
    for delta in deltas:
        function = delta["function"]
        if delta["index"] == len(calls):
            assert delta["type"] == "function" and delta["id"] and function["name"]
            calls.append({"id": delta["id"], "name": function["name"],
                          "arguments": function["arguments"],
                          "streamed": function["arguments"] == ""})
            continue
        assert delta["index"] == len(calls) - 1, "a call's deltas follow its head"
        assert set(delta) == {"index", "function"} and set(function) == {"arguments"}
        calls[-1]["arguments"] += function["arguments"]
    return calls


ARGS = '{"city": "Paris", "note": "say \\"}\\" and { \\\\", "days": [1, {"x": []}]}'
STREAMED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": ' + ARGS
     + '}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
     '<tool_call>{"name": "g", "arguments": {"b": 2}}</tool_call>'),   # text args: whole
    ("hermes", '<tool_call>{"arguments": {"b": 2}, "name": "g"}</tool_call>'),   # key order
    ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": ' + ARGS
     + '}; {"name": "time", "parameters": {}}<|eot_id|>'),
    ("llama3_json", ' {"name": "f", "parameters": {"x": [1]}}'),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "weather", "arguments": ' + ARGS
     + '}, {"name": "time", "arguments": {}}]</s>'),
    ("mistral", "[TOOL_CALLS]weather[ARGS]" + ARGS + "[TOOL_CALLS]time[ARGS]{}</s>"),
    ("hermes", "No call here, just < and <tool and text."),
    ("llama3_json", "Plain answer {with braces}.<|eot_id|>"),
    ("mistral", "[TOOL not a call"),
]


@pytest.mark.parametrize("name, text", STREAMED)
@pytest.mark.parametrize("seed", range(6))
def test_streamed_calls_add_up_to_the_whole_parse(name: str, text: str, seed: int) -> None:
    parser = TOOL_PARSERS[name]()
    content, deltas, calls = streamed(parser, text, seed)
    whole_content, whole_calls = parser.parse(text)
    assert content == whole_content
    sent = assembled(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in sent] \
        == [(c.name, json.loads(c.arguments)) for c in whole_calls]
    assert [c["id"] for c in sent] == [c.id for c in calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls] \
        == [(c.name, json.loads(c.arguments)) for c in whole_calls]
    for call in sent:     # streamed raw: exactly the text the model wrote
        assert call["arguments"] in text or not call["streamed"]
    if ARGS in text:      # heads in the usual form: every call streams, not only the first
        assert len(sent) == 2 and all(call["streamed"] for call in sent)
    if calls:             # content sent before the calls never holds part of a marker
        assert not any(marker in content for marker in parser.markers)


@pytest.mark.parametrize("name, text", [STREAMED[0], STREAMED[3], STREAMED[5], STREAMED[6]])
def test_arguments_stream_as_they_come(name: str, text: str) -> None:
    """Fed a character at a time, the first call's head goes out once its arguments object
    opens, and each character of that object goes out as it comes, the object's closing
    brace last (nothing of what closes the call)."""
    stream = ToolCallStream(TOOL_PARSERS[name]())
    start = text.index(ARGS)
    for at, char in enumerate(text[:start + len(ARGS) + 1]):
        _, deltas = stream.feed(char)
        if at < start:
            assert deltas == []
        elif at == start:
            head, first = deltas
            assert head["function"] == {"name": "weather", "arguments": ""}
            assert first == {"index": 0, "function": {"arguments": "{"}}
        elif at < start + len(ARGS):
            assert deltas == [{"index": 0, "function": {"arguments": char}}]
        else:     # the call's own closing text: held until the next head
            assert deltas == []


@pytest.mark.parametrize("seed", range(4))
def test_a_call_that_does_not_parse_is_content(seed: int) -> None:
    """Cut off after its arguments: streamed, the call had opened (its deltas were sent),
    and then the text from where the calls began comes as content with no calls, so the
    content adds up to the whole reply's, as when it comes whole."""
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}'
    parser = HermesParser()
    content, deltas, calls = streamed(parser, text, seed)
    assert parser.parse(text) == (text, []) and (content, calls) == (text, [])
    assert [(c["name"], c["arguments"]) for c in assembled(deltas)] == [("f", '{"a": 1}')]
    # A call whose head never became whole sends nothing but content.
    text = 'Hi <tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    assert streamed(parser, text, seed) == (text, [], [])


def test_a_stream_holds_back_only_what_may_begin_a_marker() -> None:
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("box>") == ("<toolbox>", [])
    stream = ToolCallStream(Llama3JsonParser())
    assert stream.feed("  ") == ("", []) and stream.feed("Hi") == ("  Hi", [])


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_an_end_of_turn_text_is_not_streamed(step: int) -> None:
    """With special tokens kept (for the markers), a text reply ends in the end-of-turn
    token's text: left out; the same text inside the reply stays."""
    text = "It is <|eot_id|> sunny.<|eot_id|>"
    assert streamed(Llama3JsonParser(), text, step=step) == ("It is <|eot_id|> sunny.", [], [])
