"""Error objects: their OpenAI shape, field paths of bodies that do not parse (unknown fields
named all at once), the scheduler's status codes as HTTP statuses, and the field a scheduler
message is about."""

from typing import Any

import grpc
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from http_svc.errors import ApiError, from_grpc, from_validation, grpc_fields_named
from http_svc.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest


def parse_error(model: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ValidationError) as invalid:
        model.model_validate(body)
    return from_validation(invalid.value)


def test_the_openai_error_shape() -> None:
    assert ApiError(404, "no such model", "model").body() == {"error": {
        "message": "no such model", "type": "NotFoundError", "param": "model", "code": 404}}
    assert ApiError(503, "down").body()["error"]["type"] == "ServiceUnavailableError"
    assert ApiError(405, "no").body()["error"]["type"] == "MethodNotAllowed"


def test_forbidden_fields_are_named_all_at_once() -> None:
    """Request models ignore fields they do not declare (tests/http_svc/test_protocol.py);
    a model that forbids them still gets every one named."""
    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")
        a: int = 0

    with pytest.raises(ValidationError) as exc:
        Strict.model_validate({"foo": 1, "bar": 2})
    error = from_validation(exc.value)
    assert (error.status, error.message, error.param) == (400, "unknown fields: foo, bar", "foo")


def test_type_errors_name_the_field_where_it_was_written() -> None:
    error = parse_error(CompletionRequest, {"prompt": "x", "max_tokens": "many"})
    assert error.param == "max_tokens" and error.message.startswith("max_tokens: ")
    # A union's member names (str, list[int], ...) are not part of the path.
    assert parse_error(CompletionRequest, {"prompt": {"a": 1}}).param == "prompt"
    assert parse_error(CompletionRequest, {}).param == "prompt"
    error = parse_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert error.param == "messages[0].content"
    assert parse_error(DetokenizeRequest, {"tokens": [1, -2]}).param == "tokens[1]"


class RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.ABORTED, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.UNIMPLEMENTED, 501),
    (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNKNOWN, 500),
])
def test_grpc_status_codes(code: grpc.StatusCode, status: int) -> None:
    error = from_grpc(RpcError(code, "why"))
    assert (error.status, error.message) == (status, "why")


@pytest.mark.parametrize("message, param", [
    ("temperature must be >= 0, got -1", "temperature"),
    ("max_tokens 99 plus the prompt's 8190 tokens exceeds ...", "max_tokens"),
    ("min_tokens must be in [0, max_tokens=5], got 9", "min_tokens"),
    ("at most 16 stop strings of at most 256 characters", "stop"),
    ("stop token id 99999 is outside the vocabulary", "stop_token_ids"),
    ("prompt has 9000 tokens; the model's context is 8192 tokens", "messages"),
    ("chat message 0 has role 'wizard'; roles are system, user, assistant, tool", "messages"),
    ("logprobs must be in [0, 20], got 30", "top_logprobs"),
    ("cache_salt is 300 bytes of UTF-8; at most 256 are allowed", "cache_salt"),
    ("something else", None),
])
def test_a_scheduler_message_names_its_field(message: str, param: str | None) -> None:
    with pytest.raises(ApiError) as raised, grpc_fields_named("messages", "top_logprobs"):
        raise from_grpc(RpcError(grpc.StatusCode.INVALID_ARGUMENT, message))
    assert raised.value.param == param


def test_only_unnamed_client_errors_get_a_field() -> None:
    with pytest.raises(ApiError) as raised, grpc_fields_named("prompt"):
        raise ApiError(503, "prompt is fine, the cluster is not")
    assert raised.value.param is None
    with pytest.raises(ApiError) as raised, grpc_fields_named("prompt"):
        raise ApiError(400, "top_p must be in (0, 1]", "top_p")
    assert raised.value.param == "top_p"
