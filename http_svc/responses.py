"""OpenAI's Responses API (POST /v1/responses) for text and function tools, as a chat
completion underneath: `instructions` and `input` become chat messages (input text parts,
earlier `function_call` items as an assistant's tool calls, `function_call_output` items as
tool messages), the flat function tools and tool choice the chat's nested ones, `text.format`
the response_format, `max_output_tokens` the chat's limit. The chat's reply comes back as
output items: `reasoning` (with a reasoning parser), a `message` of `output_text`, and one
`function_call` per call. Streamed: http_svc.responses_stream.

Nothing is stored (`store` is accepted and ignored): `previous_response_id` is a 400, and
the client sends the conversation in `input`, as with chat. Built-in tools (web search, file
search, ...) and non-text input parts are a 400 naming them.
"""

import time
import uuid
from typing import Any

from http_svc.errors import bad_request, not_supported
from http_svc.protocol import ChatCompletionRequest, StrictModel
from http_svc.responses_stream import response_events, responses_usage
from http_svc.serving import OpenAIServing
from http_svc.streaming import EventStream

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(StrictModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None      # effort / summary: accepted, ignored
    truncation: str | None = None
    background: bool | None = None               # needs stored responses: refused when true


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request a Responses request amounts to."""
    if body.previous_response_id:
        raise not_supported("previous_response_id", "responses are not stored; send the "
                            "conversation in input")
    if body.background:
        raise not_supported("background", "responses are not stored")
    if body.truncation not in (None, "disabled"):
        raise not_supported("truncation", 'only "disabled" is accepted')
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    if not messages:
        raise bad_request("input must hold at least one message", "input")
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "temperature": body.temperature,
        "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls, "stream": body.stream,
        "tools": [_tool(t, i) for i, t in enumerate(body.tools)] if body.tools else None,
        "tool_choice": _tool_choice(body.tool_choice)}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    fields["response_format"] = _format(body.text)
    return ChatCompletionRequest.model_validate(fields)


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            content = [_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        messages.append({"role": item.get("role", "user"), "content": content})
    elif kind == "function_call":
        call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)     # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else str(output)})
    elif kind != "reasoning":      # an earlier reply's reasoning: not shown to the template
        raise bad_request(f"{where}.type {kind!r} is not supported: message, function_call, "
                          "function_call_output and reasoning items are", f"{where}.type")


def _text_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
        raise bad_request(f"{where}.type {part.get('type')!r} is not supported: only text parts "
                          f"({', '.join(TEXT_PARTS)}) are", f"{where}.type")
    return {"type": "text", "text": part["text"]}


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(f"tools[{i}].type {tool.get('type')!r} is not supported: only "
                          "function tools are", f"tools[{i}].type")
    return {"type": "function", "function": {k: tool[k] for k in
                                             ("name", "description", "parameters")
                                             if k in tool}}


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    spec = (text or {}).get("format")
    if spec is None or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": spec.get("name", "output"),
                                                       "schema": spec.get("schema")}}
    return {"type": spec.get("type")}


def response_head(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """What a response object holds besides its status, output and usage."""
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
            "created_at": int(time.time()), "model": model, "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "user": body.user}


def output_items(message: dict[str, Any], done: bool = True) -> list[dict[str, Any]]:
    """A chat reply's message as Responses output items."""
    status = "completed" if done else "incomplete"
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "content": [{"type": "reasoning_text",
                                   "text": message["reasoning_content"]}]})
    if message.get("content") or not message.get("tool_calls"):
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": message.get("content") or "",
                                   "annotations": [], "logprobs": []}]})
    for call in message.get("tool_calls") or ():
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


async def responses(serving: OpenAIServing, body: ResponsesRequest,
                    ) -> dict[str, Any] | EventStream:
    chat = to_chat(body)
    result = await serving.chat(chat)
    card = await serving.client.model_card()
    head = response_head(body, card.name)
    if isinstance(result, EventStream):
        return response_events(head, result)
    choice = result["choices"][0]
    done = choice["finish_reason"] != "length"
    return {**head, "status": "completed" if done else "incomplete",
            "incomplete_details": None if done else {"reason": "max_output_tokens"},
            "output": output_items(choice["message"], done),
            "usage": responses_usage(result["usage"])}
