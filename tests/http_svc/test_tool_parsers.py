"""Tool calls read out of reply text in each format (http_svc.tool_parsers): the calls and
the content before them, malformed calls left as content, end-of-turn text left out."""

import json

import pytest

from http_svc.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolParser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}


def calls_of(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parser.parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_after_some_text() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": '
            + json.dumps(WEATHER) + '}\n</tool_call>\n<tool_call>\n{"name": "time", '
            '"arguments": {}}\n</tool_call>')
    assert calls_of(HermesParser(), text) == ("Let me check.\n", [("weather", WEATHER),
                                                                  ("time", {})])
    # The last call may lack its closing tag (the turn ended there); arguments may be text.
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}'
    assert calls_of(HermesParser(), text) == ("", [("f", {"a": 1})])


def test_llama3_json_calls_are_the_whole_reply() -> None:
    text = ('<|python_tag|>{"name": "weather", "parameters": ' + json.dumps(WEATHER)
            + '}; {"name": "time", "parameters": {}}<|eot_id|>')
    assert calls_of(Llama3JsonParser(), text) == ("", [("weather", WEATHER), ("time", {})])
    assert calls_of(Llama3JsonParser(), ' {"name": "f", "parameters": {"x": [1]}}') \
        == (" ", [("f", {"x": [1]})])
    # JSON later in a reply is not a call (Llama 3 calls only open a reply).
    text = 'Here: {"name": "f", "parameters": {}}'
    assert calls_of(Llama3JsonParser(), text) == (text, [])


def test_mistral_array_and_args_forms() -> None:
    content, calls = MistralParser().parse(
        'Sure. [TOOL_CALLS] [{"name": "weather", "arguments": ' + json.dumps(WEATHER)
        + '}, {"name": "time", "arguments": {}}]</s>')
    assert content == "Sure. " and [c.name for c in calls] == ["weather", "time"]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)   # Mistral's call ids
    assert calls_of(MistralParser(), '[TOOL_CALLS]weather[ARGS]' + json.dumps(WEATHER)
                    + '[TOOL_CALLS]time[ARGS]{}') == ("", [("weather", WEATHER), ("time", {})])


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), "Hi <tool_call>{not json}</tool_call>"),
    (HermesParser(), '<tool_call>{"arguments": {}}</tool_call>'),           # no name
    (HermesParser(), '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    (Llama3JsonParser(), '{"name": "f", "parameters": {}} and more words'),
    (MistralParser(), "[TOOL_CALLS] [{\"name\": \"f\""),                   # cut short
])
def test_a_malformed_call_leaves_the_reply_as_content(parser: ToolParser, text: str) -> None:
    assert parser.parse(text) == (text, [])


def test_an_end_of_turn_text_is_not_content() -> None:
    """With special tokens kept (for the markers), a text reply ends in the end-of-turn
    token's text: left out; the same text inside the reply stays."""
    text = "It is <|eot_id|> sunny.<|eot_id|>"
    assert Llama3JsonParser().parse(text) == ("It is <|eot_id|> sunny.", [])
    assert MistralParser().parse("Hi</s>") == ("Hi", [])
    assert HermesParser().parse("Hi</s>") == ("Hi</s>", [])       # no trailer of its own
