"""Tool choice (http_svc.tools): which replies are read for calls, the flags "auto" needs
(as vLLM), the schemas that force `required` and named calls (checked against outputs with
jsonschema), and the fields a bad tool or choice is refused by."""

import json
from typing import Any

import jsonschema
import pytest

from http_svc.config import HttpConfig
from http_svc.errors import ApiError
from http_svc.protocol import ChatCompletionRequest
from http_svc.tools import AUTO_NEEDS_FLAGS, forced_calls, plan_tools

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}
AUTO = HttpConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields})


def refused(config: HttpConfig = AUTO, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as error:
        plan_tools(chat(**fields), config)
    assert error.value.status == 400
    return error.value


def test_auto_is_the_default_with_tools_and_needs_the_flags() -> None:
    plan = plan_tools(chat(tools=[WEATHER]), AUTO)
    assert plan.mode == "auto" and plan.parser is not None and plan.parser.name == "hermes"
    assert plan.structured is None
    error = refused(HttpConfig(), tools=[WEATHER])
    assert (error.message, error.param) == (AUTO_NEEDS_FLAGS, "tool_choice")
    assert refused(HttpConfig(tool_call_parser="hermes"), tools=[WEATHER],
                   tool_choice="auto").param == "tool_choice"
    assert plan_tools(chat(), HttpConfig()).mode == "none"
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none"), HttpConfig()).mode == "none"


def test_special_token_markers_keep_special_tokens() -> None:
    for parser, keep in (("hermes", False), ("mistral", True), ("llama3_json", True)):
        config = HttpConfig(tool_call_parser=parser, enable_auto_tool_choice=True)
        assert plan_tools(chat(tools=[WEATHER]), config).keep_special_tokens is keep


def test_required_forces_an_array_of_known_calls() -> None:
    plan = plan_tools(chat(tools=[WEATHER, TIME], tool_choice="required"), HttpConfig())
    assert plan.mode == "required" and plan.structured is not None
    assert plan.structured.param == "tool_choice"
    schema = json.loads(plan.structured.json_schema or "")
    good = [{"name": "weather", "parameters": {"city": "Paris"}},
            {"name": "time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "weather",
                                                             "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = forced_calls(json.dumps(good))
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Paris"}), ("time", {})]
    assert forced_calls('[{"name": "weather", "param') is None      # cut by the length
    one = plan_tools(chat(tools=[WEATHER, TIME], tool_choice="required",
                          parallel_tool_calls=False), HttpConfig())
    assert json.loads(one.structured.json_schema or "")["maxItems"] == 1   # type: ignore[union-attr]


def test_a_named_function_is_forced_by_its_parameters() -> None:
    for choice in ({"type": "function", "function": {"name": "weather"}},
                   {"type": "function", "name": "weather"}):     # the Responses API's form
        plan = plan_tools(chat(tools=[WEATHER, TIME], tool_choice=choice), HttpConfig())
        assert plan.mode == "named" and plan.function == "weather"
        assert plan.structured is not None
        assert json.loads(plan.structured.json_schema or "") == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),                           # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "custom"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
])
def test_bad_tools_and_choices_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields).param == param
