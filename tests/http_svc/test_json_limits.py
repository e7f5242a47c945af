"""http_svc.json_limits: the depth of a JSON text, measured before parsing, against a slow
twin that walks it byte by byte; and the front end's refusals of deep bodies and oversized
fields, through the ASGI app with no scheduler behind it."""

import json
import logging
import random
import time
from typing import Any

import grpc
import pytest

from http_svc.app import build_app
from http_svc.config import HttpConfig
from http_svc.errors import from_grpc
from http_svc.json_limits import (
    MAX_JSON_DEPTH,
    json_depth,
    json_text_longer_than,
    nested_deeper_than,
)
from http_svc.serving import OpenAIServing
from tests.http_svc.test_app import Reply, drive
from tests.http_svc.test_serving import Ready
from tests.http_svc.test_serving_tools import ScriptedClient


def slow_depth(text: str) -> int:
    """The reference: one byte at a time, tracking strings and escapes."""
    level = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            deepest = max(deepest, level)
        elif ch in "]}":
            level -= 1
    return deepest


TRICKY_STRINGS = ["", "[", "]]]", "{[", '"', "\\", '\\"[', "a\\\\", "\\\\\"]", "x\ny", "é[ü"]


def random_json(rng: random.Random, depth: int) -> object:
    roll = rng.random()
    if depth == 0 or roll < 0.3:
        return rng.choice([1, None, True, rng.choice(TRICKY_STRINGS)])
    if roll < 0.65:
        return [random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {rng.choice(TRICKY_STRINGS) + str(i): random_json(rng, depth - 1)
            for i in range(rng.randrange(4))}


def test_depth_matches_a_byte_by_byte_walk() -> None:
    rng = random.Random(7)
    for _ in range(500):
        text = json.dumps(random_json(rng, rng.randrange(12)), ensure_ascii=rng.random() < 0.5)
        assert json_depth(text) == slow_depth(text), text


@pytest.mark.parametrize("text, depth", [
    ("1", 0), ("[]", 1), ('{"a": [1, {"b": 2}]}', 3), ('["[[[[", "]]"]', 1),
    ('{"k\\"[": ["\\\\", [[]]]}', 4), ('"\\\\\\"[["', 0), ("[" * 300 + "]" * 300, 300),
])
def test_depth_of_known_texts(text: str, depth: int) -> None:
    assert json_depth(text) == depth == slow_depth(text)
    assert json_depth(text.encode()) == depth


def test_the_limit_is_exclusive() -> None:
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert not nested_deeper_than(at_limit)
    assert nested_deeper_than("[" + at_limit + "]")
    # Brackets in strings do not count, however many.
    assert not nested_deeper_than(json.dumps({"a": "[" * 10_000}))


def test_deep_and_large_bodies_are_measured_fast() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    many_strings = json.dumps([f'a\\"[{i}' for i in range(200_000)]).encode()
    start = time.perf_counter()
    assert nested_deeper_than(deep)
    assert not nested_deeper_than(many_strings)
    assert time.perf_counter() - start < 2.0


# -- through the app (no scheduler: the scripted stand-in of tests.http_svc.test_app) --------

def post(path: str, data: bytes) -> Reply:
    app = build_app(HttpConfig())
    app.state.serving = OpenAIServing(ScriptedClient("Hello."), Ready(True))  # type: ignore[arg-type]
    return Reply(drive(app, "POST", path, data, [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def chat(content: str, more: str = "", role: str = "user") -> str:
    """A chat body as text, so that `content` and `more` may nest past what json.dumps can."""
    return ('{"messages": [{"role": "' + role + '", "content": ' + content + '}], '
            '"max_tokens": 2' + more + "}")


COMPLETION = {"prompt": "hi", "max_tokens": 2}
DEEP = 100_000
TOO_DEEP = f"request body nested deeper than {MAX_JSON_DEPTH} levels"


@pytest.mark.parametrize("path, data", [
    ("/v1/completions", nested(DEEP)),
    ("/v1/chat/completions", chat(nested(DEEP))),
    ("/v1/chat/completions", chat('"hi"', ', "response_format": {"type": "json_schema", '
                                  '"json_schema": {"name": "x", "schema": {"a": '
                                  + nested(DEEP) + "}}}")),
    ("/tokenize", '{"prompt": "hi", "x": ' + nested(DEEP) + "}"),
])
def test_a_deep_body_is_refused_before_it_is_parsed(path: str, data: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        reply = post(path, data.encode())
    assert (reply.status, reply.json()["error"]["message"]) == (400, TOO_DEEP)
    assert not [r for r in caplog.records if r.exc_info]


def test_a_schema_sent_as_json_text_is_measured_too() -> None:
    for field, body in (("guided_json", {"guided_json": nested(DEEP)}),
                        ("structured_outputs.json",
                         {"structured_outputs": {"json": nested(DEEP)}})):
        reply = post("/v1/completions", json.dumps({**COMPLETION, **body}).encode())
        error = reply.json()["error"]
        assert (reply.status, error["param"]) == (400, field)
        assert error["message"] == f"{field} is nested deeper than {MAX_JSON_DEPTH} levels"


ENUM = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "string", "enum": [str(i) for i in range(1_000_000)]}}}


@pytest.mark.parametrize("fields, param, limit", [
    ({"stop_token_ids": list(range(1_000_000))}, "stop_token_ids", "1024"),
    ({"guided_choice": ["a"] * 1_000_000}, "guided_choice", "1024"),
    ({"structured_outputs": {"choice": [str(i) for i in range(2000)]}}, "structured_outputs",
     "1024"),
    ({"structured_outputs": {"choice": ["x" * 70_000]}}, "structured_outputs", "65536"),
    ({"response_format": ENUM}, "response_format", "65536"),
    ({"guided_regex": "a" * 1_000_000}, "guided_regex", "16384"),
    ({"guided_grammar": "root ::= " + "a" * 1_000_000}, "guided_grammar", "65536"),
    ({"stop": ["s"] * 1_000_000}, "stop", "16"),
    ({"stop": "s" * 1_000_000}, "stop", "256"),
    ({"stop": ["ok", "s" * 300]}, "stop", "256"),
    ({"cache_salt": "c" * 1_000_000}, "cache_salt", "256"),
    ({"logit_bias": {str(i): 1 for i in range(100_000)}}, "logit_bias", "1024"),
])
def test_an_oversized_field_is_named_with_its_limit(fields: dict[str, Any], param: str,
                                                     limit: str) -> None:
    reply = post("/v1/completions", json.dumps({**COMPLETION, **fields}).encode())
    error = reply.json()["error"]
    assert (reply.status, error["param"]) == (400, param), error
    assert limit in error["message"]


def test_the_json_length_bound_never_refuses_what_fits() -> None:
    """A lower bound: whatever it calls longer than the limit is, compact or not; at the
    exact compact length it says no, one below it yes (quote-free texts)."""
    rng = random.Random(5)
    for _ in range(2000):
        value = random_json(rng, rng.randrange(6))
        compact = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
        for limit in (0, 1, compact // 2, compact - 1, compact, compact + 1):
            if json_text_longer_than(value, limit):
                assert compact > limit, (value, limit)
    plain = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(50)}}
    exact = len(json.dumps(plain, separators=(",", ":")))
    assert not json_text_longer_than(plain, exact)
    assert json_text_longer_than(plain, exact - 1)


class Trap(dict):  # type: ignore[type-arg]
    def items(self):  # type: ignore[no-untyped-def]
        raise AssertionError("walked past the limit")


def test_the_json_length_bound_stops_at_the_limit() -> None:
    """A million-item enum is refused after the items that pass the limit: nothing after
    them is visited (the trap at item 50,000 never springs), nothing is copied."""
    enum: list[Any] = ["x"] * 50_000 + [Trap(a=1)] + ["x"] * 950_000
    assert json_text_longer_than({"type": "string", "enum": enum}, 64 << 10)


def test_a_huge_role_is_named() -> None:
    reply = post("/v1/chat/completions", chat('"hi"', role="r" * 100_000).encode())
    assert (reply.status, reply.json()["error"]["param"]) == (400, "messages[0].role")


# -- gRPC's size refusals ----------------------------------------------------------------------

class RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("details, status", [
    ("SERVER: Received message larger than max (3000123 vs. 2375680)", 413),
    ("CLIENT: Sent message larger than max (17825797 vs. 16777216)", 413),
    ("CLIENT: Received message larger than max (17825797 vs. 16777216)", 500),
    ("300 requests are live; try again later", 429),
])
def test_grpc_size_refusals_are_never_429(details: str, status: int) -> None:
    error = from_grpc(RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, details))
    assert error.status == status
    if status == 413:
        assert "3000123" in error.message or "17825797" in error.message
        assert "Received message" not in error.message and "Sent message" not in error.message


def test_the_front_ends_limits_are_the_schedulers() -> None:
    """The front end refuses by name exactly what the scheduler would refuse later."""
    from http_svc import protocol, sampling
    from scheduler_svc.frontend import structured_output, validation

    assert (sampling.MAX_STOP_STRINGS, sampling.MAX_STOP_LEN, protocol.MAX_STOP_TOKEN_IDS) == (
        validation.MAX_STOP_STRINGS, validation.MAX_STOP_LEN, validation.MAX_STOP_TOKEN_IDS)
    assert validation.MAX_JSON_DEPTH == MAX_JSON_DEPTH
    assert (protocol.MAX_CHOICES, sampling.MAX_SCHEMA_BYTES, sampling.MAX_REGEX_BYTES,
            sampling.MAX_GRAMMAR_BYTES, sampling.MAX_CHOICE_BYTES) == (
        structured_output.MAX_CHOICES, structured_output.MAX_SCHEMA_BYTES,
        structured_output.MAX_REGEX_BYTES, structured_output.MAX_GRAMMAR_BYTES,
        structured_output.MAX_CHOICE_BYTES)
