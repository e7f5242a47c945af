"""The ASGI app's own behaviour, driven with ASGI messages (no sockets; the scheduler client
is the scripted stand-in): fields a request model does not declare are ignored with one
rate-limited warning naming them, X-Request-Id on every response (echoed or made up), /ping,
/tokenizer_info and /v1/responses routed."""

import asyncio
import json
import logging
from typing import Any

import pytest

from http_svc.app import build_app
from http_svc.config import HttpConfig
from http_svc.ignored import IgnoredFieldsWarning
from http_svc.serving import OpenAIServing
from tests.http_svc.test_serving import Ready
from tests.http_svc.test_serving_tools import ScriptedClient


class Reply:
    def __init__(self, messages: list[dict[str, Any]]) -> None:
        start = next(m for m in messages if m["type"] == "http.response.start")
        self.status = start["status"]
        self.headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
        self.body = b"".join(m.get("body", b"") for m in messages
                             if m["type"] == "http.response.body")

    def json(self) -> Any:
        return json.loads(self.body)


def call(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         ready: bool = True, text: str = "Hello.") -> Reply:
    app = build_app(HttpConfig())
    app.state.serving = OpenAIServing(ScriptedClient(text), Ready(ready))  # type: ignore[arg-type]
    data = json.dumps(body).encode() if body is not None else b""
    return Reply(drive(app, method, path, data, [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]))


def drive(app: Any, method: str, path: str, body: bytes,
          headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    """One request through `app` as an ASGI server would hand it over (the body in one
    message, the client staying connected); the messages the app sent back."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000), "headers": headers}
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)          # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_unknown_fields_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("http_svc.app.warn_ignored", IgnoredFieldsWarning())
    with caplog.at_level(logging.WARNING, "http_svc.ignored"):
        reply = call("POST", "/v1/chat/completions", {
            **CHAT, "foo": 1, "messages": [{"role": "user", "content": "hi", "audio": None}],
            "stream_options": None})
    assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello."
    (record,) = caplog.records
    assert record.getMessage() == ("ChatCompletionRequest: ignored unknown fields foo, "
                                   "messages[0].audio")


def test_what_vllm_clients_send_is_accepted_without_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "http_svc.ignored"):
        for path, body in (
                ("/v1/chat/completions", {
                    **CHAT, "reasoning_effort": "low", "metadata": {"a": "b"}, "store": False,
                    "messages": [{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": "hi"}],
                    "chat_template_kwargs": {"enable_thinking": False},
                    "add_special_tokens": False, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
                ("/v1/completions", {"prompt": "hi", "add_special_tokens": True}),
                ("/tokenize", {"prompt": "hi", "add_special_tokens": False})):
            reply = call("POST", path, body)
            assert reply.status == 200, (path, reply.body)
    assert not caplog.records


def test_the_warning_is_rate_limited() -> None:
    now = [0.0]
    warn = IgnoredFieldsWarning(10.0, lambda: now[0])
    assert warn("R", ["a"]) and not warn("R", ["b"]) and not warn("R", ["c"])
    assert not warn("R", [])
    now[0] = 11.0
    assert warn("R", ["d"])


def test_x_request_id_is_echoed_or_made() -> None:
    reply = call("GET", "/health", headers={"X-Request-Id": "abc-123"})
    assert reply.headers["x-request-id"] == "abc-123"
    made = call("POST", "/v1/chat/completions", {**CHAT, "stream": True}).headers
    assert len(made["x-request-id"]) == 32          # streamed responses carry one too
    assert call("GET", "/nope", headers={"X-Request-Id": "bad id\t"}).headers[
        "x-request-id"] != "bad id\t"


def test_ping_is_health() -> None:
    assert call("GET", "/ping").status == 200 and call("POST", "/ping").status == 200
    assert call("GET", "/ping", ready=False).status == 503


def test_tokenizer_info_and_responses_are_routed() -> None:
    info = call("GET", "/tokenizer_info").json()
    assert info["model_max_length"] == 100 and info["tokenizer_class"]
    reply = call("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 5})
    assert reply.status == 200 and reply.json()["output"][0]["content"][0]["text"] == "Hello."
    bad = call("POST", "/v1/responses", {"input": "hi", "previous_response_id": "r"})
    assert bad.status == 400 and bad.json()["error"]["param"] == "previous_response_id"
