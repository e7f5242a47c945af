"""Chat messages onto what the gRPC API carries (role and text, tool fields, tools and
documents): text parts joined as vLLM joins them, other parts and what the API cannot carry to
the template refused by name."""

import json
from typing import Any

import pytest

from http_svc.chat import (
    ChatExtras,
    chat_extras,
    extras_num_bytes,
    flatten_messages,
    refuse_template_inputs,
)
from http_svc.errors import ApiError
from http_svc.protocol import ChatCompletionRequest
from http_svc.scheduler_client import Prompt, chat_to_pb


def request(messages: list[dict[str, Any]], **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def flat(*messages: dict[str, Any]) -> list[tuple[str, str]]:
    return flatten_messages(request(list(messages)).messages)


def refused(*messages: dict[str, Any], **fields: Any) -> ApiError:
    body = request(list(messages), **fields)
    with pytest.raises(ApiError) as error:
        refuse_template_inputs(body)
        flatten_messages(body.messages)
    assert error.value.status == 400
    return error.value


def test_text_parts_are_joined_with_newlines() -> None:
    assert flat({"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None}) == [
        ("system", "Be brief."), ("user", "a\nb"), ("assistant", "")]
    assert flat({"role": "user", "content": []}) == [("user", "")]


def test_other_parts_are_refused_by_position() -> None:
    user = {"role": "user", "content": [{"type": "text", "text": "look"},
                                        {"type": "image_url", "image_url": {"url": "x"}}]}
    error = refused({"role": "system", "content": "s"}, user)
    assert error.param == "messages[1].content[1].type"
    assert "'image_url' is not supported" in error.message
    bad_text = {"role": "user", "content": [{"type": "text", "text": 3}]}
    assert refused(bad_text).param == "messages[0].content[0].text"
    extra = {"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}
    assert refused(extra).param == "messages[0].content[0].cache"


def test_tools_documents_and_tool_fields_are_carried_as_json() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    documents = [{"title": "t", "text": "x"}]
    body = request([{"role": "user", "content": "x", "name": "bob"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"}],
                   tools=tools, documents=documents)
    extras = chat_extras(body)
    assert extras == ChatExtras((("bob", "", ""), ("", "", json.dumps([call])),
                                 ("", "c1", "")), json.dumps(tools), json.dumps(documents))
    assert extras_num_bytes(extras) == len("bob" + json.dumps([call]) + "c1"
                                           + json.dumps(tools) + json.dumps(documents))
    pb = chat_to_pb(Prompt(chat=tuple(flatten_messages(body.messages)), chat_extras=extras))
    assert [(m.role, m.name, m.tool_call_id) for m in pb.messages] == [
        ("user", "bob", ""), ("assistant", "", ""), ("tool", "", "c1")]
    assert json.loads(pb.messages[1].tool_calls_json) == [call]
    assert json.loads(pb.tools_json) == tools and json.loads(pb.documents_json) == documents
    assert chat_extras(request([{"role": "user", "content": "x"}], tools=[])) is None
    assert extras_num_bytes(None) == 0


@pytest.mark.parametrize("fields, param", [
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_template_inputs_are_refused_not_dropped(fields: dict[str, Any], param: str) -> None:
    assert refused({"role": "user", "content": "x"}, **fields).param == param


def test_empty_template_inputs_are_no_inputs() -> None:
    body = request([{"role": "user", "content": "x"}], tools=[], documents=[],
                   chat_template_kwargs={}, tool_choice="none", parallel_tool_calls=False)
    refuse_template_inputs(body)
    refuse_template_inputs(request([{"role": "user", "content": "x"}], tool_choice="auto"))


def test_template_kwargs_are_carried_as_json() -> None:
    body = request([{"role": "user", "content": "x"}],
                   chat_template_kwargs={"enable_thinking": False})
    refuse_template_inputs(body)
    extras = chat_extras(body)
    assert extras is not None and json.loads(extras.template_kwargs_json) == {
        "enable_thinking": False}
    assert extras_num_bytes(extras) == len(extras.template_kwargs_json)
    assert json.loads(chat_to_pb(Prompt(chat=(("user", "x"),), chat_extras=extras))
                      .chat_template_kwargs_json) == {"enable_thinking": False}


def test_the_developer_role_is_the_system_role() -> None:
    body = request([{"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": "x"}])
    assert flatten_messages(body.messages) == [("system", "Be brief."), ("user", "x")]
