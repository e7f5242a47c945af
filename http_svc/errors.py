"""OpenAI-style error objects and where they come from: the front end's own checks
(`ApiError`), request bodies that do not parse into a request model (`from_validation`) and
the scheduler's gRPC status codes (`from_grpc`).

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with the
HTTP status in `code`, the shape vLLM's OpenAI server answers with (the `openai` client reads
`message` and raises the exception class of the status). `param` names the request field at
fault where one is known, as `messages[0].content`.
"""

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

import grpc
from pydantic import ValidationError

# Error types by status, as vLLM names them.
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError",
               429: "RateLimitError", 500: "InternalServerError", 501: "NotImplementedError",
               503: "ServiceUnavailableError", 504: "TimeoutError"}

# The scheduler's status codes (proto/splitserve/v1/generation.proto) as HTTP statuses.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,       # no or a wrong API key (services.api_keys)
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,    # too many live requests: try again later
    grpc.StatusCode.UNAVAILABLE: 503,           # no ready replica, draining, scheduler down
    grpc.StatusCode.ABORTED: 503,               # work lost, not resumable: a retry may succeed
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}


# Names pydantic gives a union's plain members in an error's location; no request field has one.
UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list"})


# The scheduler's INVALID_ARGUMENT messages begin with the field they are about; by those first
# words, the request field. "PROMPT" stands for the prompt's own field (prompt or messages).
GRPC_MESSAGE_FIELDS = (
    (re.compile(r"(temperature|top_p|top_k|max_tokens|min_tokens|seed|cache_salt|min_p|n|"
                r"presence_penalty|frequency_penalty|repetition_penalty|logit_bias)\b"), None),
    (re.compile(r"logprobs\b"), "logprobs"),
    (re.compile(r"stop token id"), "stop_token_ids"),
    (re.compile(r"(at most \d+ )?stop strings"), "stop"),
    (re.compile(r"(prompt|token id|chat|rendered chat)\b"), "PROMPT"),
    (re.compile(r"unknown model"), "model"),
    (re.compile(r"structured_output\b"), "STRUCTURED"),
)


class ApiError(Exception):
    """A request the front end answers with an error object instead of a result."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def not_supported(param: str, why: str = "") -> ApiError:
    """A parameter the engine does not have yet, given a value other than its neutral one."""
    return bad_request(f"{param} is not supported yet{': ' + why if why else ''}", param)


def field_path(loc: Sequence[int | str]) -> str:
    """pydantic's error location as a field path: ("messages", 0, "content") becomes
    "messages[0].content"."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def from_validation(exc: ValidationError) -> ApiError:
    """The first problem of a body that does not parse into the request model; unknown fields
    are named all at once."""
    errors = exc.errors(include_url=False)
    unknown = [field_path(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return bad_request(f"unknown field{'s' if len(unknown) > 1 else ''}: "
                           f"{', '.join(unknown)}", unknown[0])
    first = errors[0]
    # A union's members add their type names to the location ("prompt", "list[int]", 0):
    # the field is where the user wrote the value, so keep names of fields and indexes only.
    loc = [p for p in first["loc"]
           if isinstance(p, int) or (p.isidentifier() and p not in UNION_TAGS)]
    path = field_path(loc)
    return bad_request(f"{path}: {first['msg']}" if path else first["msg"], path or None)


def from_grpc(exc: grpc.aio.AioRpcError) -> ApiError:
    """The scheduler's refusal as an HTTP error; its message already names the field."""
    status = GRPC_TO_HTTP.get(exc.code(), 500)
    details = exc.details() or exc.code().name
    if status == 503 and exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in details:
        details = f"the scheduler cannot be reached: {details}"
    return ApiError(status, details)


@contextmanager
def grpc_fields_named(prompt_param: str, logprobs_param: str = "logprobs",
                      structured_param: str | None = None) -> Iterator[None]:
    """Gives a 400 from the scheduler the request field its message begins with, as `param`
    (`prompt_param` for the prompt, `logprobs_param` for the logprobs count,
    `structured_param` for the output constraint)."""
    try:
        yield
    except ApiError as exc:
        if exc.status == 400 and exc.param is None:
            exc.param = _grpc_field(exc.message, prompt_param, logprobs_param,
                                    structured_param)
        raise


def _grpc_field(message: str, prompt_param: str, logprobs_param: str,
                structured_param: str | None = None) -> str | None:
    for pattern, param in GRPC_MESSAGE_FIELDS:
        if (match := pattern.match(message)) is not None:
            if param == "PROMPT":
                return prompt_param
            if param == "STRUCTURED":
                return structured_param
            if param == "logprobs":
                return logprobs_param
            return param or match.group(1)
    return None
