"""A chat request's tools and `tool_choice`, as vLLM's OpenAI server reads them, onto how its
reply is read (`ToolPlan`):

- `none`: the tools reach the chat template, the reply is text.
- `auto` (the default when there are tools): the model decides; `--tool-call-parser` reads
  its calls out of the text. Without `--enable-auto-tool-choice` it is a 400, as in vLLM.
- `required`: at least one call, forced by a JSON schema through structured output (the
  scheduler's grammar): an array of `{"name", "parameters"}`, each name one of the tools
  (at most one item with `parallel_tool_calls: false`).
- a named function (`{"type": "function", "function": {"name": ...}}`): the reply is that
  function's arguments, forced by its parameters' schema.

Forced calls need no parser; they cannot be combined with response_format or guided_*.
"""

import json
from dataclasses import dataclass
from typing import Any

from http_svc.config import HttpConfig
from http_svc.errors import bad_request
from http_svc.structured import Structured
from http_svc.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser, call_id

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str                            # "none", "auto", "required" or "named"
    parser: ToolParser | None = None     # auto: reads the calls out of the text
    function: str | None = None          # named: the function called
    structured: Structured | None = None   # required / named: the grammar forcing the call

    @property
    def keep_special_tokens(self) -> bool:
        """The parser's markers are special tokens, which outputs leave out by default."""
        return self.parser is not None and self.parser.keep_special_tokens


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """Each tool's function name; 400 naming the first tool that is not a function."""
    names = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}',
                              f"tools[{i}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string",
                              f"tools[{i}].function.name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools[{i}].function.parameters")
        names.append(function["name"])
    return names


def plan_tools(request: Any, config: HttpConfig) -> ToolPlan:
    """The request's ToolPlan; 400 naming the field for a choice it cannot have."""
    tools = request.tools or None
    names = tool_names(tools)
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none")
    if tools is None:
        if choice == "auto":
            return ToolPlan("none")
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice == "auto":
        parser = config.tool_call_parser
        if parser is None or not config.enable_auto_tool_choice:
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan("auto", parser=TOOL_PARSERS[parser]())
    parameters = {n: t["function"].get("parameters") or {"type": "object"}
                  for n, t in zip(names, tools)}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                    "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for n, schema in parameters.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if request.parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolPlan("required", structured=Structured("tool_choice",
                                                          json_schema=json.dumps(array)))
    name = _named(choice)
    if name not in parameters:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                          "tool_choice.function.name")
    return ToolPlan("named", function=name,
                    structured=Structured("tool_choice", json_schema=json.dumps(parameters[name])))


def _named(choice: Any) -> str:
    """The function a tool_choice object names (chat's nested form or the Responses API's
    flat one)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if isinstance(name, str):
            return name
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                      '"function": {"name": ...}}', "tool_choice")


def forced_calls(text: str) -> list[ToolCall] | None:
    """The calls of a `required` reply (the schema's array); None if it does not parse (the
    output was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list):
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ToolCall(item["name"], json.dumps(item.get("parameters", {}),
                                                       ensure_ascii=False), call_id()))
    return calls
