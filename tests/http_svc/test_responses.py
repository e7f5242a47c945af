"""The Responses API (http_svc.responses, http_svc.responses_stream): a request's input,
instructions, tools and format onto a chat request; the chat's reply as output items, whole
and as typed stream events; what it refuses by name."""

import asyncio
import json
from typing import Any

import pytest

from http_svc.config import HttpConfig
from http_svc.errors import ApiError
from http_svc.responses import ResponsesRequest, responses, to_chat
from http_svc.serving import OpenAIServing
from tests.http_svc.test_serving import Ready
from tests.http_svc.test_serving_tools import ScriptedClient

TOOL = {"type": "function", "name": "weather", "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "Hi", **fields})


def test_input_and_instructions_become_messages() -> None:
    chat = to_chat(request(instructions="Be brief.", max_output_tokens=9))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."),
                                                           ("user", "Hi")]
    assert chat.max_completion_tokens == 9
    chat = to_chat(request(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": []}], tools=[TOOL], tool_choice="required"))
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool"]      # parallel calls: one assistant turn
    assert [c["id"] for c in chat.messages[1].tool_calls or ()] == ["c1", "c2"]
    assert chat.messages[2].tool_call_id == "c1" and chat.messages[2].content == "sunny"
    assert chat.tools == [{"type": "function", "function": {
        "name": "weather", "description": "The weather", "parameters": TOOL["parameters"]}}]
    assert chat.tool_choice == "required"
    named = to_chat(request(tools=[TOOL], tool_choice={"type": "function", "name": "weather"}))
    assert named.tool_choice == {"type": "function", "function": {"name": "weather"}}
    schema = {"type": "object"}
    formatted = to_chat(request(text={"format": {"type": "json_schema", "name": "x",
                                                 "schema": schema}}))
    assert formatted.response_format == {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": []}, "input"),
])
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        to_chat(request(**fields))
    assert refused.value.param == param


def serve(client: ScriptedClient, body: ResponsesRequest,
          config: HttpConfig = HttpConfig()) -> Any:
    serving = OpenAIServing(client, Ready(), config)  # type: ignore[arg-type]

    async def go() -> Any:
        result = await responses(serving, body)
        if hasattr(result, "events"):
            return [e async for e in result.events]
        return result

    return asyncio.run(go())


def test_a_text_reply() -> None:
    response = serve(ScriptedClient("Hello there."), request(max_output_tokens=20))
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["status"] == "completed"
    (item,) = response["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0] == {"type": "output_text", "text": "Hello there.",
                                  "annotations": [], "logprobs": []}
    assert response["usage"]["input_tokens"] == 7 and response["usage"]["output_tokens"] == 1
    cut = serve(ScriptedClient("Hel", "length"), request(max_output_tokens=1))
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_function_calls() -> None:
    client = ScriptedClient('[{"name": "weather", "parameters": {"city": "Rome"}}]')
    response = serve(client, request(tools=[TOOL], tool_choice="required"))
    (item,) = response["output"]
    assert item["type"] == "function_call" and item["name"] == "weather"
    assert json.loads(item["arguments"]) == {"city": "Rome"}
    assert item["call_id"].startswith("call_") and item["status"] == "completed"


def events_of(raw: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for event in raw:
        kind, data = event.decode().split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}" and event.endswith(b"\n\n")
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_a_streamed_text_reply() -> None:
    events = events_of(serve(ScriptedClient("Hello there."), request(stream=True)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hello there."
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello there."
    assert final["usage"]["output_tokens"] == 6 and final["status"] == "completed"


def test_streamed_function_calls_and_reasoning() -> None:
    client = ScriptedClient('<think>hm</think><tool_call>{"name": "weather", "arguments": '
                            '{"city": "Rome"}}</tool_call>')
    config = HttpConfig(tool_call_parser="hermes", enable_auto_tool_choice=True,
                        reasoning_parser="qwen3")
    events = events_of(serve(client, request(stream=True, tools=[TOOL]), config))
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "hm"
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(done[0]["arguments"]) == {"city": "Rome"}
    assert final["output"][1]["name"] == "weather"
