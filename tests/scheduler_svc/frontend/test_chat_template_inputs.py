"""Tools, documents and messages' tool fields reach the chat template as transformers'
apply_chat_template passes them; `--chat-template` replaces the model's template (a file or
inline), and a template that does not compile stops the scheduler at start with a message
that says so."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_svc.frontend.tokenizer import (
    ChatMessage,
    TemplateError,
    load_tokenizer,
    read_chat_template,
)
from tests.scheduler_svc.frontend.test_chat_templates import TEMPLATES, tokenizer_dir

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
DOCUMENTS = [{"title": "Paris", "text": "Capital of France."},
             {"title": "Lyon", "text": "Known for food."}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATION = [
    {"role": "system", "content": "You use tools."},
    {"role": "user", "content": "Weather in Paris?", "name": "ann"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def message(m: dict) -> ChatMessage:  # type: ignore[type-arg]
    return ChatMessage(m["role"], m["content"], m.get("name"), m.get("tool_call_id"),
                       m.get("tool_calls"))


@pytest.mark.parametrize("tools, documents", [(TOOLS, DOCUMENTS), (TOOLS, None),
                                              (None, DOCUMENTS), (None, None)])
def test_tools_and_documents_render_as_transformers_renders_them(
        tmp_path: Path, tools: list | None, documents: list | None) -> None:  # type: ignore[type-arg]
    from transformers import AutoTokenizer

    path = tokenizer_dir(tmp_path, "chatml_qwen")
    template = (TEMPLATES / "tools_documents.jinja").read_text()
    theirs = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        CONVERSATION, tools=tools, documents=documents, chat_template=template, tokenize=False,
        add_generation_prompt=True)
    ours = load_tokenizer(path, template).render_chat(
        [message(m) for m in CONVERSATION], True, tools, documents)
    assert ours == theirs
    assert ("# Tools" in ours) == (tools is not None)
    assert ("Known for food." in ours) == (documents is not None)
    assert '<tool_call>{"name": "get_weather"' in ours and "(ann)" in ours


def test_the_model_template_sees_tools_from_the_request(tmp_path: Path) -> None:
    """The family template that reads `tools` (Qwen style) gets them; without, it does not."""
    from transformers import AutoTokenizer

    path = tokenizer_dir(tmp_path, "chatml_qwen")
    user = [{"role": "user", "content": "hi"}]
    theirs = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        user, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    ours = load_tokenizer(path).render_chat([message(user[0])], True, TOOLS)
    assert ours == theirs and json.dumps(TOOLS[0], ensure_ascii=False) in ours


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path: Path) -> None:
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0].content }}!")
    assert read_chat_template(str(file)) == "{{ messages[0].content }}!"
    assert read_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ValueError, match="no such file, and not a template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path, "llama3"), read_chat_template(str(file)))
    assert tokenizer.render_chat([ChatMessage("user", "hey")], True) == "hey!"
    assert tokenizer.chat_template == "{{ messages[0].content }}!"


def test_a_template_that_does_not_compile_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="--chat-template: chat template does not parse"):
        load_tokenizer(tokenizer_dir(tmp_path, "llama3"), "{% if messages %}unclosed")


def test_the_scheduler_stops_at_start_on_a_bad_template(model_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", "--model", str(model_path), "--port", "0",
         "--control-port", "0", "--metrics-port", "-1", "--chat-template", "{% for %}"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "SPLITSERVE_CLUSTER_TOKEN": "t" * 32})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--chat-template: chat template does not parse" in result.stderr
    assert "Traceback" not in result.stderr


def test_grpc_chat_fields_are_parsed_and_bad_json_is_invalid_argument() -> None:
    from scheduler_svc.frontend.servicer import chat_from_pb
    from scheduler_svc.frontend.validation import InvalidRequest, Limits, validate_chat
    from services.rpc.splitserve.v1 import generation_pb2 as pb

    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hi", name="ann"),
                  pb.ChatMessage(role="assistant", tool_calls_json=json.dumps([CALL])),
                  pb.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")],
        tools_json=json.dumps(TOOLS), documents_json=json.dumps(DOCUMENTS))
    prompt = chat_from_pb(chat)
    assert prompt.tools == TOOLS and prompt.documents == DOCUMENTS
    assert prompt.chat == [ChatMessage("user", "hi", "ann"),
                           ChatMessage("assistant", "", tool_calls=[CALL]),
                           ChatMessage("tool", "sunny", tool_call_id="call_1")]
    assert chat_from_pb(pb.ChatMessages(messages=[pb.ChatMessage(role="user")])).tools is None
    for bad, match in [(pb.ChatMessages(tools_json="{"), "tools_json is not valid JSON"),
                       (pb.ChatMessages(documents_json='{"a": 1}'),
                        "documents_json must be a JSON array of objects"),
                       (pb.ChatMessages(messages=[pb.ChatMessage(tool_calls_json="[1]")]),
                        "chat message 0 tool_calls_json must be")]:
        with pytest.raises(InvalidRequest, match=match):
            chat_from_pb(bad)
    limits = Limits("m", 100, 50, max_prompt_bytes=len(json.dumps(TOOLS)) + 1)
    validate_chat([ChatMessage("user", "")], limits, TOOLS)
    with pytest.raises(InvalidRequest, match="chat content is"):   # the tools count
        validate_chat([ChatMessage("user", "hi")], limits, TOOLS)
