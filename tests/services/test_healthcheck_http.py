"""services.healthcheck --http, the HTTP API's container probe, against a real HTTP server:
healthy on a 2xx answer only, one line printed, exit 1 (never 2) otherwise."""

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.healthcheck import main


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/version" else 503)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    (line,) = capsys.readouterr().out.splitlines()
    return code, line


def test_a_2xx_answer_is_healthy(base: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "--http", f"{base}/version") == (0, f"{base}/version: HTTP 200")


def test_any_other_answer_is_not(base: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "--http", f"{base}/health") == (1, f"{base}/health: HTTP 503")


def test_nobody_listening(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, line = run(capsys, "--http", f"http://127.0.0.1:{port}/version", "--timeout", "1")
    assert code == 1 and "refused" in line.lower()


def test_one_form_at_a_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["127.0.0.1:1", "--http", "http://127.0.0.1:1/"]) == 1
