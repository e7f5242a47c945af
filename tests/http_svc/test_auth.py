"""API keys on the HTTP API (http_svc.auth), the ASGI middleware driven directly: 401 with an
OpenAI-style error object for a missing or wrong key (never echoing it), the open paths, the
presented key handed on to the scheduler client; and the scheduler client (http_svc.
scheduler_client) sending it as gRPC metadata to a real server that checks keys, over
plaintext and over TLS. Without keys the HTTP client's host is handed on instead, and a
Generate call declares it as the client the scheduler queues the request for."""

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from http_svc.auth import ApiKeyMiddleware, client_host, presented_key
from http_svc.errors import ApiError
from http_svc.sampling import Sampling
from http_svc.scheduler_client import GenerateSpec, Prompt, SchedulerClient
from scheduler_svc.frontend.auth import ApiKeyInterceptor
from services import tls
from services.api_keys import CLIENT_METADATA_KEY, INVALID, MISSING, ApiKeys
from services.grpc_server import bind, make_server
from services.rpc.splitserve.v1 import generation_pb2 as pb
from services.rpc.splitserve.v1 import generation_pb2_grpc
from tests.services.tls_files import self_signed

KEY = "http-key-000111"


def call(keys: ApiKeys, path: str, authorization: str | None = None,
         method: str = "GET") -> tuple[int, dict[str, str], Any, list[str | None]]:
    """(status, headers, JSON body or None, the key the app saw) of one request."""
    seen: list[str | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(presented_key.get())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers,
             "query_string": b"", "root_path": ""}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(ApiKeyMiddleware(app, keys)(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            json.loads(body) if body else None, seen)


@pytest.mark.parametrize("authorization, message", [
    (None, MISSING), ("Basic " + KEY, MISSING), ("Bearer", MISSING),
    ("Bearer wrong-key", INVALID), ("Bearer " + KEY + "x", INVALID)])
def test_a_missing_or_wrong_key_is_401(authorization: str | None, message: str) -> None:
    for path in ("/v1/completions", "/v1/models", "/tokenize", "/docs"):
        status, headers, body, seen = call(ApiKeys([KEY]), path, authorization, "POST")
        assert status == 401 and seen == []          # the route never ran
        assert body == ApiError(401, message).body()
        assert body["error"]["message"] == message and "wrong-key" not in json.dumps(body)
        assert headers["www-authenticate"] == "Bearer"


def test_a_configured_key_passes_and_is_handed_on() -> None:
    keys = ApiKeys(["other", KEY])
    status, _, _, seen = call(keys, "/v1/chat/completions", f"Bearer {KEY}", "POST")
    assert status == 200 and seen == [KEY]
    assert presented_key.get() is None                # reset after the request


def test_probes_metrics_and_preflights_are_open() -> None:
    for path in ("/health", "/ping", "/version", "/metrics"):
        status, _, _, seen = call(ApiKeys([KEY]), path)
        assert status == 200 and seen == [None]
    assert call(ApiKeys([KEY]), "/v1/completions", method="OPTIONS")[0] == 200
    assert call(ApiKeys([KEY]), "/health/x")[0] == 401


def test_without_keys_everything_is_open_and_a_key_is_still_handed_on() -> None:
    assert call(ApiKeys(), "/v1/completions", None, "POST")[3] == [None]
    assert call(ApiKeys(), "/v1/completions", "Bearer for-the-scheduler",
                "POST")[3] == ["for-the-scheduler"]


def host_handed_on(keys: ApiKeys, client: tuple[str, int] | None,
                   authorization: str | None = None) -> tuple[str | None, str | None]:
    """(the client host the app saw, and what it is after the request) for a request from
    `client` (the ASGI scope's)."""
    seen: list[str | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(client_host.get())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message: dict[str, Any]) -> None:
        pass

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
             "query_string": b"", "root_path": "", "client": client}
    asyncio.run(ApiKeyMiddleware(app, keys)(scope, receive, send))
    return seen[0], client_host.get()


def test_without_keys_the_client_host_is_handed_on() -> None:
    assert host_handed_on(ApiKeys(), ("203.0.113.9", 5555)) == ("203.0.113.9", None)
    assert host_handed_on(ApiKeys(), None) == (None, None)       # no address known
    # With keys, the key names the client: no host is handed on.
    assert host_handed_on(ApiKeys([KEY]), ("203.0.113.9", 5555), f"Bearer {KEY}") == (
        None, None)


class ModelServicer(generation_pb2_grpc.GenerationServicer):
    async def ModelInfo(self, request: pb.ModelInfoRequest,  # type: ignore[override]
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(model="m", max_model_len=64, vocab_size=10)


def client_calls(ssl: tuple[Path, Path] | None) -> list[tuple[str | None, object]]:
    """(key presented, model name or HTTP status) of ModelInfo through a SchedulerClient."""
    async def main() -> list[tuple[str | None, object]]:
        server = make_server(first=[ApiKeyInterceptor(ApiKeys([KEY]))])
        generation_pb2_grpc.add_GenerationServicer_to_server(ModelServicer(), server)
        credentials = None if ssl is None else tls.server_credentials(str(ssl[0]), str(ssl[1]))
        port = bind(server, "127.0.0.1", 0, credentials)
        await server.start()
        client = SchedulerClient(f"127.0.0.1:{port}", None if ssl is None else str(ssl[0]))
        results: list[tuple[str | None, object]] = []
        try:
            for key in (None, "wrong", KEY):
                client.forget_model()
                token = presented_key.set(key)
                try:
                    results.append((key, (await client.model_card()).name))
                except ApiError as exc:
                    results.append((key, exc.status))
                finally:
                    presented_key.reset(token)
        finally:
            await client.close()
            await server.stop(None)
        return results
    return asyncio.run(main())


def test_the_scheduler_client_sends_the_clients_key() -> None:
    assert client_calls(None) == [(None, 401), ("wrong", 401), (KEY, "m")]


def test_the_scheduler_client_over_tls(tmp_path: Path) -> None:
    assert client_calls(self_signed(tmp_path)) == [(None, 401), ("wrong", 401), (KEY, "m")]


def test_http_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    capsys: pytest.CaptureFixture[str]) -> None:
    from http_svc.__main__ import parse_config

    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SPLITSERVE_API_KEY", "k1,k2")
    config = parse_config(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                           "--scheduler-ssl-ca", str(cert)])
    assert config.api_keys == ("k1", "k2") and "k1" not in repr(config)
    assert (config.ssl_certfile, config.ssl_keyfile, config.scheduler_ssl_ca) == (
        str(cert), str(key), str(cert))
    assert parse_config(["--api-key", "k3"]).api_keys == ("k3",)
    for argv, words in [(["--ssl-keyfile", str(key)], "--ssl-keyfile needs --ssl-certfile"),
                        (["--scheduler-ssl-ca", str(tmp_path / "none.pem")],
                         "--scheduler-ssl-ca")]:
        with pytest.raises(SystemExit):
            parse_config(argv)
        assert words in capsys.readouterr().err


class EchoServicer(generation_pb2_grpc.GenerationServicer):
    """Answers a Generate with one final message; keeps each call's metadata."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def GenerateOnce(self, request: pb.GenerateRequest,  # type: ignore[override]
                           context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        self.metadata.append(dict(context.invocation_metadata() or ()))
        return pb.GenerateResponse(finish_reason="stop")


def test_a_generate_call_declares_the_http_client() -> None:
    async def main() -> list[dict[str, str]]:
        servicer, server = EchoServicer(), make_server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = bind(server, "127.0.0.1", 0, None)
        await server.start()
        client = SchedulerClient(f"127.0.0.1:{port}")
        spec = GenerateSpec("r", Prompt(text="hi"),
                            Sampling(None, None, None, None, None, 0, (), (), False, None, False))
        try:
            for host, key in (("203.0.113.9", None), (None, KEY), ("x" * 300, None)):
                tokens = client_host.set(host), presented_key.set(key)
                try:
                    async for _ in client.generate(spec, whole=True):
                        pass
                finally:
                    client_host.reset(tokens[0])
                    presented_key.reset(tokens[1])
        finally:
            await client.close()
            await server.stop(None)
        return servicer.metadata

    plain, keyed, long = asyncio.run(main())
    assert plain[CLIENT_METADATA_KEY] == "203.0.113.9" and "authorization" not in plain
    assert CLIENT_METADATA_KEY not in keyed and keyed["authorization"] == f"Bearer {KEY}"
    assert long[CLIENT_METADATA_KEY] == "x" * 128    # within what the scheduler takes
