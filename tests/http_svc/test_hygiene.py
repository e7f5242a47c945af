"""HTTP hygiene of the front end (issue 40): a half-sent request is answered 408 and closed
after the read timeout, a silent connection is closed, an idle keep-alive connection is not;
connections past the cap get 503 while one below it is served; POST bodies must be declared
JSON (415 otherwise); CORS is off unless origins are listed. Socket-level cases run a real
uvicorn on a free port with `http_svc.__main__`'s protocol; the rest drive the ASGI app."""

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn

from http_svc.app import build_app
from http_svc.config import HttpConfig
from http_svc.content_type import JSON_BODY_PATHS
from http_svc.serving import OpenAIServing
from http_svc.slow_clients import protocol_factory
from tests.http_svc.test_app import drive
from tests.http_svc.test_serving import Ready
from tests.http_svc.test_serving_tools import ScriptedClient

HOST = "127.0.0.1"
COMPLETION = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()


def app_for(config: HttpConfig) -> Any:
    app = build_app(config)
    app.state.serving = OpenAIServing(ScriptedClient("Hello."), Ready())  # type: ignore[arg-type]
    return app


@contextmanager
def serving(config: HttpConfig, keep_alive_s: int = 5) -> Iterator[int]:
    """A real uvicorn with the front end's protocol on a free port, on its own thread."""
    server = uvicorn.Server(uvicorn.Config(
        app_for(config), host=HOST, port=0, lifespan="off", log_config=None,
        timeout_keep_alive=keep_alive_s,
        http=protocol_factory(config.request_read_timeout_s,  # type: ignore[arg-type]
                              config.max_connections)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=10)


def request(body: bytes = COMPLETION, content_type: str = "application/json",
            path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response with a content-length body, the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def status_and_error(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.parametrize("part", [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-ty",             # headers cut
    request()[:-20],                                                        # body cut
])
def test_twenty_half_sent_requests_get_408_and_are_closed_after_the_timeout(
        part: bytes, caplog: pytest.LogCaptureFixture) -> None:
    config = HttpConfig(request_read_timeout_s=0.5)
    with serving(config) as port:
        socks = [connect(port) for _ in range(20)]
        start = time.monotonic()
        for sock in socks:
            sock.sendall(part)
        control = connect(port)                         # served meanwhile
        control.sendall(request())
        assert read_response(control)[0] == 200
        assert time.monotonic() - start < 0.5
        answers = [read_until_closed(sock) for sock in socks]
        elapsed = time.monotonic() - start
    assert 0.4 < elapsed < 2.0, elapsed
    for raw in answers:
        status, error = status_and_error(raw)
        assert status == 408 and "--request-read-timeout" in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    refusals = [r for r in caplog.records if "request not sent within" in r.getMessage()]
    assert len(refusals) == 1, "one rate-limited line for 20 refusals of one address"


def test_a_silent_connection_is_closed_without_an_answer() -> None:
    with serving(HttpConfig(request_read_timeout_s=0.3)) as port, connect(port) as sock:
        start = time.monotonic()
        assert read_until_closed(sock) == b""
        assert time.monotonic() - start < 1.5


def test_a_slow_answer_and_an_idle_keep_alive_connection_are_not_cut() -> None:
    """The deadline covers reading a request, not answering it nor the wait for the next
    one (that is uvicorn's keep-alive timeout)."""
    with serving(HttpConfig(request_read_timeout_s=0.3), keep_alive_s=3) as port, \
            connect(port) as sock:
        sock.sendall(request()[:30])
        time.sleep(0.1)
        sock.sendall(request()[30:])            # whole within the deadline
        assert read_response(sock)[0] == 200
        time.sleep(0.8)                          # idle past the read timeout
        sock.sendall(request())
        assert read_response(sock)[0] == 200


def test_a_body_answered_early_is_still_bounded_by_the_deadline() -> None:
    """A 415 is sent before the body is read: the rest of the body must still come within
    the deadline (else the connection is closed); once it has, the connection is an idle
    keep-alive one again."""
    head = request(b" " * 100, content_type="text/plain")[:-90]
    with serving(HttpConfig(request_read_timeout_s=0.3), keep_alive_s=3) as port:
        with connect(port) as trickle:
            trickle.sendall(head)
            assert read_response(trickle)[0] == 415
            start = time.monotonic()
            assert read_until_closed(trickle) == b""
            assert time.monotonic() - start < 1.0
        with connect(port) as sock:
            sock.sendall(head)
            assert read_response(sock)[0] == 415
            sock.sendall(b" " * 90)
            time.sleep(0.8)                       # idle past the read timeout
            sock.sendall(request())
            assert read_response(sock)[0] == 200


def test_connections_past_the_cap_get_503_and_one_below_it_is_served(
        caplog: pytest.LogCaptureFixture) -> None:
    with serving(HttpConfig(max_connections=3)) as port:
        held = [connect(port) for _ in range(3)]
        time.sleep(0.2)
        with connect(port) as over:
            over.sendall(request())
            status, error = status_and_error(read_until_closed(over))
        assert status == 503 and "--max-connections" in error["message"]
        held.pop().close()
        time.sleep(0.2)
        with connect(port) as control:
            control.sendall(request())
            assert read_response(control)[0] == 200
        for sock in held:
            sock.close()
    assert sum("over the cap of 3" in r.getMessage() for r in caplog.records) == 1


def call(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"",
         config: HttpConfig | None = None) -> tuple[int, dict[str, str], bytes]:
    sent = drive(app_for(config or HttpConfig()), method, path, body,
                 [(b"host", b"x"), *headers])
    start = next(m for m in sent if m["type"] == "http.response.start")
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


@pytest.mark.parametrize("content_type", [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    None, "text/plain; application/json"])
@pytest.mark.parametrize("path", sorted(JSON_BODY_PATHS))
def test_a_body_not_declared_json_gets_415_naming_its_type(path: str,
                                                           content_type: str | None) -> None:
    headers = [] if content_type is None else [(b"content-type", content_type.encode())]
    status, _, body = call("POST", path, headers, COMPLETION)
    error = json.loads(body)["error"]
    assert status == 415 and error["code"] == 415
    assert (content_type or "no Content-Type") in error["message"]
    assert "application/json" in error["message"]


@pytest.mark.parametrize("content_type", [
    "application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"])
def test_json_with_or_without_parameters_is_accepted(content_type: str) -> None:
    status, _, _ = call("POST", "/v1/completions", [(b"content-type", content_type.encode())],
                        COMPLETION)
    assert status == 200


def test_every_post_route_with_a_body_checks_its_content_type() -> None:
    posts = {route.path for route in app_for(HttpConfig()).routes
             if "POST" in getattr(route, "methods", ())}
    assert posts - {"/ping"} == set(JSON_BODY_PATHS)
    assert call("POST", "/ping", [])[0] == 200            # no body, no type needed


PREFLIGHT = [(b"origin", b"https://page.example"), (b"access-control-request-method", b"POST"),
             (b"access-control-request-headers", b"content-type, authorization")]


def test_cors_is_off_by_default() -> None:
    status, headers, _ = call("OPTIONS", "/v1/completions", PREFLIGHT)
    assert status >= 400 and not any(k.startswith("access-control-") for k in headers)
    status, headers, _ = call("POST", "/v1/completions", [
        (b"origin", b"https://page.example"), (b"content-type", b"application/json")],
        COMPLETION)
    assert status == 200 and not any(k.startswith("access-control-") for k in headers)


def test_cors_allows_listed_origins_only() -> None:
    config = HttpConfig(allowed_origins=("https://page.example",))
    status, headers, _ = call("OPTIONS", "/v1/completions", PREFLIGHT, config=config)
    assert status == 200 and headers["access-control-allow-origin"] == "https://page.example"
    assert "authorization" in headers["access-control-allow-headers"].lower()
    other = [(b"origin", b"https://evil.example"), *PREFLIGHT[1:]]
    status, headers, _ = call("OPTIONS", "/v1/completions", other, config=config)
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = call("POST", "/v1/completions", [
        (b"origin", b"https://page.example"), (b"content-type", b"application/json")],
        COMPLETION, config=config)
    assert status == 200 and headers["access-control-allow-origin"] == "https://page.example"


def test_a_star_allows_any_origin() -> None:
    status, headers, _ = call("OPTIONS", "/v1/completions", PREFLIGHT,
                              config=HttpConfig(allowed_origins=("*",)))
    assert status == 200 and headers["access-control-allow-origin"] == "*"
