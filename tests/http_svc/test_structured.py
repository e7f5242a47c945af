"""Structured output parameters over HTTP (http_svc.structured): response_format, vLLM's
structured_outputs and guided_json / guided_regex / guided_choice / guided_grammar onto the gRPC
StructuredOutput, malformed ones and
more than one refused with a 400 naming the field, and the scheduler's refusal of a schema
it cannot compile named as the field it came from. No network."""

import json
from typing import Any

import pytest

from http_svc.errors import ApiError, grpc_fields_named
from http_svc.protocol import ChatCompletionRequest, CompletionRequest
from http_svc.sampling import chat_sampling, completion_sampling
from http_svc.scheduler_client import GenerateSpec, Prompt, spec_to_pb
from http_svc.structured import Structured, param_of

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> Structured | None:
    body = ChatCompletionRequest.model_validate({"messages": USER, **fields})
    return chat_sampling(body).structured


def completion(**fields: Any) -> Structured | None:
    return completion_sampling(CompletionRequest.model_validate({"prompt": "x", **fields})
                               ).structured


def refusal(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as refused:
        chat(**fields)
    assert refused.value.status == 400
    return refused.value


def test_free_text_has_no_constraint() -> None:
    assert chat() is None
    assert chat(response_format={"type": "text"}) is None
    assert completion(response_format={"type": "text"}) is None


def test_each_form_maps_to_its_constraint() -> None:
    schema_text = json.dumps(SCHEMA)
    assert chat(response_format={"type": "json_object"}) == Structured(
        "response_format", json_object=True)
    assert chat(response_format={"type": "json_schema",
                                 "json_schema": {"name": "city", "schema": SCHEMA}}
                ) == Structured("response_format", json_schema=schema_text)
    assert completion(guided_json=SCHEMA) == Structured("guided_json", json_schema=schema_text)
    assert completion(guided_json=schema_text) == Structured("guided_json",
                                                             json_schema=schema_text)
    assert completion(guided_regex=r"\d+") == Structured("guided_regex", regex=r"\d+")
    assert completion(guided_choice=["a", "b"]) == Structured("guided_choice", choice=("a", "b"))
    assert chat(structured_outputs={"json": SCHEMA}) == Structured(
        "structured_outputs", json_schema=schema_text)
    assert chat(structured_outputs={"regex": "a+", "grammar": None}) == Structured(
        "structured_outputs", regex="a+")
    assert chat(structured_outputs={"choice": ["x"]}) == Structured("structured_outputs",
                                                                   choice=("x",))
    assert chat(structured_outputs={"json_object": True}) == Structured(
        "structured_outputs", json_object=True)
    grammar = 'root ::= "yes" | "no"'
    assert completion(guided_grammar=grammar) == Structured("guided_grammar", grammar=grammar)
    assert chat(structured_outputs={"grammar": grammar}) == Structured("structured_outputs",
                                                                        grammar=grammar)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
    ({"guided_json": "{nope"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": ["root ::= x"]}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_grammar": "  "}, "guided_grammar"),
    ({"guided_regex": "a", "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
])
def test_malformed_or_several_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    assert refusal(**fields).param == param


def test_the_grpc_request_carries_it() -> None:
    sampling = completion_sampling(CompletionRequest.model_validate(
        {"prompt": "x", "guided_choice": ["yes", "no"]}))
    request = spec_to_pb(GenerateSpec("r", Prompt(text="x"), sampling))
    so = request.sampling.structured_output
    assert list(so.choice) == ["yes", "no"]
    assert not so.HasField("json_schema") and not so.HasField("regex") and not so.json_object
    sampling = completion_sampling(CompletionRequest.model_validate(
        {"prompt": "x", "guided_json": SCHEMA}))
    so = spec_to_pb(GenerateSpec("r", Prompt(text="x"), sampling)).sampling.structured_output
    assert json.loads(so.json_schema) == SCHEMA and not so.choice
    plain = spec_to_pb(GenerateSpec("r", Prompt(text="x"), completion_sampling(
        CompletionRequest.model_validate({"prompt": "x"}))))
    assert not plain.sampling.HasField("structured_output")


def test_the_grpc_request_carries_a_grammar() -> None:
    grammar = 'root ::= "yes" | "no"'
    sampling = chat_sampling(ChatCompletionRequest.model_validate(
        {"messages": USER, "guided_grammar": grammar}))
    so = spec_to_pb(GenerateSpec("r", Prompt(text="x"), sampling)).sampling.structured_output
    assert so.HasField("grammar") and so.grammar == grammar
    assert not so.HasField("regex") and not so.HasField("json_schema") and not so.choice


def test_a_grammar_the_scheduler_cannot_parse_names_the_field() -> None:
    for fields, param in (({"guided_grammar": "root ::= "}, "guided_grammar"),
                          ({"structured_outputs": {"grammar": "root ::= "}},
                           "structured_outputs")):
        structured = chat(**fields)
        with pytest.raises(ApiError) as refused, grpc_fields_named(
                "messages", "top_logprobs", param_of(structured)):
            raise ApiError(400, "structured_output.grammar does not compile: EBNF parser error")
        assert refused.value.param == param


def test_a_schema_the_scheduler_cannot_compile_names_the_field() -> None:
    structured = chat(guided_json={"type": "bogus"})
    with pytest.raises(ApiError) as refused, grpc_fields_named(
            "messages", "top_logprobs", param_of(structured)):
        raise ApiError(400, 'structured_output.json_schema does not compile: Unsupported type')
    assert refused.value.param == "guided_json"
