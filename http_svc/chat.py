"""Chat requests onto what the public gRPC API carries: messages of a role and a text, which
the scheduler renders with the model's chat template.

A message's content is a string, null (an empty text) or a list of parts; only text parts
are taken, joined with newlines as vLLM joins them for string-content templates. Image,
audio, file and other parts are refused with a 400 naming the part. The gRPC API carries
neither tools, documents, a per-request chat template or template arguments, nor a message's
name or tool calls: a request that gives any of them a value is refused (400, naming it)
rather than rendered without it.
"""

from collections.abc import Sequence
from typing import Any

from http_svc.errors import bad_request, not_supported
from http_svc.protocol import ChatMessageParam

WHY_TEMPLATE = "the scheduler's gRPC API carries messages' role and content only"

# Chat parameters the gRPC API cannot carry to the template, with what counts as not given.
TEMPLATE_INPUTS = ("tools", "documents", "chat_template", "chat_template_kwargs")


def refuse_template_inputs(request: Any) -> None:
    """400 for a non-empty tools, documents, chat_template or chat_template_kwargs, for
    continue_final_message and for a tool_choice that asks for a tool."""
    for name in TEMPLATE_INPUTS:
        if getattr(request, name, None):
            raise not_supported(name, WHY_TEMPLATE)
    if getattr(request, "continue_final_message", False):
        raise not_supported("continue_final_message")
    choice = getattr(request, "tool_choice", None)
    if choice not in (None, "none", "auto"):   # "auto" with no tools is no tool call
        raise not_supported("tool_choice", "no tools can be given yet")


def flatten_messages(messages: Sequence[ChatMessageParam]) -> list[tuple[str, str]]:
    """Each message as (role, text). The role is checked by the scheduler (a closed set)."""
    flat: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        for name in ("name", "tool_calls", "tool_call_id"):
            if getattr(message, name):
                raise not_supported(f"messages[{i}].{name}", WHY_TEMPLATE)
        flat.append((message.role, _text(message.content, f"messages[{i}].content")))
    return flat


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
