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
    # Too many live requests: try again later. A message too large for gRPC is the same code
    # and is told apart by its text (`message_too_large`): 413, never 429.
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
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
                r"presence_penalty|frequency_penalty|repetition_penalty|logit_bias|"
                r"stop_token_ids)\b"), None),
    (re.compile(r"logprobs\b"), "logprobs"),
    (re.compile(r"stop token id"), "stop_token_ids"),
    (re.compile(r"(at most \d+ )?stop( strings|\[\d+\])?\b"), "stop"),
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


# gRPC's own refusal of a message past a channel's or server's size limit ("SERVER: Received
# message larger than max (3000123 vs. 2375680)"; "CLIENT: Sent ..." past our send limit;
# "CLIENT: Received ..." for a reply past our receive limit).
MESSAGE_TOO_LARGE = re.compile(r"(SERVER|CLIENT): (Received|Sent) message larger than max "
                               r"\((\d+) vs\. (\d+)\)")


def message_too_large(details: str) -> ApiError | None:
    """A gRPC size refusal as the client's error: a request too large for the scheduler is
    413 with its size (a client that shortens it may retry; a 429 would say "wait"). A reply
    too large for the front end is the server's fault (500). None: not a size refusal."""
    match = MESSAGE_TOO_LARGE.search(details)
    if match is None:
        return None
    side, verb, size, limit = match.groups()
    if side == "CLIENT" and verb == "Received":
        return ApiError(500, f"the scheduler's reply ({size} bytes) is larger than the "
                             f"{limit} bytes the front end reads")
    return ApiError(413, f"the request is {size} bytes as sent to the scheduler, which takes "
                         f"at most {limit}; shorten its largest fields (prompt, messages, stop, "
                         f"stop_token_ids, tools, structured output)")


def from_grpc(exc: grpc.aio.AioRpcError) -> ApiError:
    """The scheduler's refusal as an HTTP error; its message already names the field."""
    details = exc.details() or exc.code().name
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if (too_large := message_too_large(details)) is not None:
            return too_large
    status = GRPC_TO_HTTP.get(exc.code(), 500)
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
