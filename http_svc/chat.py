"""Chat requests onto what the public gRPC API carries (`ChatMessages`): messages of a role
and a text, with a message's name, tool calls and tool call id, and the request's tools,
documents and chat_template_kwargs, which the scheduler passes to the model's chat template
as HF's apply_chat_template does.

A message's content is a string, null (an empty text) or a list of parts; only text parts
are taken, joined with newlines as vLLM joins them for string-content templates. Image,
audio, file and other parts are refused with a 400 naming the part. OpenAI's `developer`
role is the system role of the models' templates (it replaced `system` for OpenAI's reasoning
models), and is sent as `system`. A per-request chat template cannot be carried (the
scheduler's template is fixed at its start, `--chat-template`; vLLM refuses one too unless
told to trust it), nor can continue_final_message: a request that gives either a value is
refused (400, naming it) rather than rendered without it. Which tool choices are served is
`http_svc.tools`.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from http_svc.errors import bad_request, not_supported
from http_svc.protocol import ChatMessageParam

WHY_TEMPLATE = "the scheduler renders chats with the template it was started with"

# Roles the front end renames for the templates.
ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True, slots=True)
class ChatExtras:
    """What a chat carries besides each message's role and text, as the gRPC fields hold it
    (JSON text; "" = not given). `messages[i]` is message i's (name, tool_call_id,
    tool_calls_json)."""

    messages: tuple[tuple[str, str, str], ...]
    tools_json: str = ""
    documents_json: str = ""
    template_kwargs_json: str = ""


def refuse_template_inputs(request: Any) -> None:
    """400 for a non-empty chat_template and for continue_final_message."""
    if getattr(request, "chat_template", None):
        raise not_supported("chat_template", WHY_TEMPLATE)
    if getattr(request, "continue_final_message", False):
        raise not_supported("continue_final_message")


def flatten_messages(messages: Sequence[ChatMessageParam]) -> list[tuple[str, str]]:
    """Each message as (role, text). The role is checked by the scheduler (a closed set)."""
    return [(ROLE_ALIASES.get(message.role, message.role),
             _text(message.content, f"messages[{i}].content"))
            for i, message in enumerate(messages)]


def chat_extras(request: Any) -> ChatExtras | None:
    """The request's tools, documents, template arguments and messages' tool fields; None
    when it has none."""
    tools = getattr(request, "tools", None) or None
    documents = getattr(request, "documents", None) or None
    kwargs = getattr(request, "chat_template_kwargs", None) or None
    per_message = tuple((m.name or "", m.tool_call_id or "",
                         json.dumps(m.tool_calls) if m.tool_calls else "")
                        for m in request.messages)
    if (tools is None and documents is None and kwargs is None
            and not any(any(x) for x in per_message)):
        return None
    return ChatExtras(per_message, json.dumps(tools) if tools else "",
                      json.dumps(documents) if documents else "",
                      json.dumps(kwargs) if kwargs else "")


def extras_num_bytes(extras: ChatExtras | None) -> int:
    """UTF-8 bytes the extras add to the prompt (they count toward its limit)."""
    if extras is None:
        return 0
    texts = [extras.tools_json, extras.documents_json, extras.template_kwargs_json,
             *(part for message in extras.messages for part in message)]
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise bad_request(f"{where}[{j}].type {kind!r} is not supported: only text parts "
                              f"({{\"type\": \"text\", \"text\": ...}}) are", f"{where}[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise bad_request(f"unknown field: {where}[{j}].{extra[0]}", f"{where}[{j}].{extra[0]}")
        texts.append(text)
    return "\n".join(texts)
