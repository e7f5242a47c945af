"""Identity at the edges, through the real services: with SPLITSERVE_API_KEY set, the public
gRPC API and the HTTP API refuse a missing or wrong key (UNAUTHENTICATED / 401 with an
OpenAI-style error) and serve a configured one (the official `openai` client with api_key=);
health stays open; http_svc hands its client's key on to the scheduler; an Abort with another
key than the request's leaves it running (found=false, as for an unknown id), across two
front ends, and that key may meanwhile use the same request id for its own request (each
key's own id space); and TLS on both APIs (--ssl-certfile/--ssl-keyfile, http_svc trusting
the scheduler's certificate), which the container healthcheck probes over TLS."""

import http.client
import json
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import healthcheck
from services.api_keys import INVALID, MISSING, call_metadata
from services.rpc.splitserve.v1 import generation_pb2 as pb
from services.rpc.splitserve.v1 import generation_pb2_grpc
from tests.e2e.harness import greedy_request, run_cluster, wait_for
from tests.services.tls_files import self_signed

pytestmark = pytest.mark.e2e

KEYS = ("e2e-key-alpha-0001", "e2e-key-beta-0002")
MAX_TOKENS = 8


def http_get(url: str, key: str | None = None, context: ssl.SSLContext | None = None,
             ) -> tuple[int, Any]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if body else None


def wait_healthy(base: str, context: ssl.SSLContext | None = None, timeout_s: float = 60,
                 ) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            if (last := http_get(f"{base}/health", context=context)[0]) == 200:
                return
        except OSError as exc:            # not listening yet
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{base}/health never answered 200 without a key: last {last}")


def assert_grpc_keys(stub: generation_pb2_grpc.GenerationStub, prompt: list[int]) -> None:
    """No key and a wrong key refused, each configured key served."""
    request = greedy_request(prompt, MAX_TOKENS)
    for metadata, why in [((), MISSING), (call_metadata("e2e-key-wrong"), INVALID),
                          ((("authorization", KEYS[0]),), MISSING)]:
        with pytest.raises(grpc.RpcError) as info:
            stub.GenerateOnce(request, timeout=30, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.details() == why
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30, metadata=metadata))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for key in KEYS:
        reply = stub.GenerateOnce(request, timeout=120, metadata=call_metadata(key))
        assert len(reply.token_ids) == MAX_TOKENS and reply.finish_reason == "length"


def assert_http_keys(base: str, context: ssl.SSLContext | None = None) -> None:
    for path in ("/health", "/version"):
        assert http_get(f"{base}{path}", context=context)[0] == 200, path
    for key, why in [(None, MISSING), ("e2e-key-wrong", INVALID)]:
        status, body = http_get(f"{base}/v1/models", key, context)
        assert status == 401
        assert body["error"]["message"] == why and body["error"]["code"] == 401
    status, body = http_get(f"{base}/v1/models", KEYS[1], context)
    assert status == 200 and body["data"], body


def test_keys_on_grpc_and_http(tmp_path: Path, prompts: list[list[int]]) -> None:
    with run_cluster(tmp_path, http=True, env={"SPLITSERVE_API_KEY": ",".join(KEYS)},
                     scheduler_args=("--frontends", "2")) as cluster:
        address = cluster.procs.address
        # Health needs no key. run_cluster waited for a SERVING answer, from whichever front
        # end its connection reached; this channel may reach the other, which can still be
        # taking the cluster's first state (NOT_SERVING, seen once in a full-suite run).
        health = health_pb2_grpc.HealthStub(cluster.channel)

        def serving() -> bool:
            request = health_pb2.HealthCheckRequest(service="splitserve.v1.Generation")
            return (health.Check(request, timeout=10).status
                    == health_pb2.HealthCheckResponse.SERVING)
        assert wait_for(serving, 30)
        assert_grpc_keys(cluster.stub, prompts[0])

        base = f"http://{cluster.procs.http_address}"
        wait_healthy(base)
        assert_http_keys(base)
        # The openai client, as vLLM users run it: api_key= is the bearer token, and http_svc
        # passes it on to the scheduler (which has the same keys).
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEYS[0], max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="The capital of France is",
                                         max_tokens=MAX_TOKENS, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0, stream=True)
        assert any(c.choices and c.choices[0].finish_reason for c in stream)
        wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="e2e-key-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=model, prompt="x", max_tokens=1)

        assert_abort_needs_the_owners_key(address, prompts[1])


def assert_abort_needs_the_owners_key(address: str, prompt: list[int]) -> None:
    """A long request made with KEYS[0]: Aborts with KEYS[1], from fresh connections (spread
    over both front ends), find nothing and leave it running; KEYS[1] runs a request of the
    same id meanwhile, answered under that id; KEYS[0]'s Abort ends its own."""
    request = greedy_request(prompt, 4000, request_id="owned-by-alpha")
    with grpc.insecure_channel(address) as channel:
        stream = generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=600, metadata=call_metadata(KEYS[0]))
        first = next(stream)
        assert first.request_id == "owned-by-alpha" and not first.finish_reason
        abort = pb.AbortRequest(request_id="owned-by-alpha")
        for _ in range(4):
            with grpc.insecure_channel(address) as other:
                stub = generation_pb2_grpc.GenerationStub(other)
                answer = stub.Abort(abort, timeout=10, metadata=call_metadata(KEYS[1]))
                assert answer.found is False
                with pytest.raises(grpc.RpcError) as info:
                    stub.Abort(abort, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        theirs = generation_pb2_grpc.GenerationStub(channel).GenerateOnce(
            greedy_request(prompt, 2, request_id="owned-by-alpha"), timeout=120,
            metadata=call_metadata(KEYS[1]))
        assert theirs.request_id == "owned-by-alpha" and len(theirs.token_ids) == 2
        more = next(stream)                        # still running
        assert not more.finish_reason and more.token_ids
        with grpc.insecure_channel(address) as other:
            answer = generation_pb2_grpc.GenerationStub(other).Abort(
                abort, timeout=10, metadata=call_metadata(KEYS[0]))
        assert answer.found is True
        rest = list(stream)
        assert rest and rest[-1].finish_reason == "abort"


def test_tls_on_both_apis(tmp_path: Path, prompts: list[list[int]]) -> None:
    cert, key = self_signed(tmp_path)
    # The scheduler's by flag (the launcher then has http_svc trust its certificate), the
    # HTTP API's by its SPLITSERVE_HTTP_* variables.
    env = {"SPLITSERVE_API_KEY": ",".join(KEYS), "SPLITSERVE_HTTP_SSL_CERTFILE": str(cert),
           "SPLITSERVE_HTTP_SSL_KEYFILE": str(key)}
    with run_cluster(tmp_path / "logs", http=True, env=env, scheduler_args=(
            "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))) as cluster:
        address = cluster.procs.address
        credentials = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(address, credentials) as channel:
            assert_grpc_keys(generation_pb2_grpc.GenerationStub(channel), prompts[0])
        with grpc.insecure_channel(address) as plaintext:     # not TLS: no answer at all
            with pytest.raises(grpc.RpcError) as info:
                generation_pb2_grpc.GenerationStub(plaintext).GenerateOnce(
                    greedy_request(prompts[0], 1), timeout=5, metadata=call_metadata(KEYS[0]))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        context = ssl.create_default_context(cafile=str(cert))
        base = f"https://{cluster.procs.http_address}"
        wait_healthy(base, context)              # http_svc reached the scheduler over TLS
        # compose's probes, given the services' certificate variables.
        assert healthcheck.main([address, "--ssl-certfile", str(cert)]) == 0
        assert healthcheck.main(["--http", f"http://{cluster.procs.http_address}/version",
                                 "--ssl-certfile", str(cert)]) == 0
        assert_http_keys(base, context)
        # Closed before the services stop: a TLS connection left open holds http_svc's
        # shutdown until the client answers its close_notify.
        with openai.OpenAI(base_url=f"{base}/v1", api_key=KEYS[0], max_retries=0,
                           timeout=120, http_client=openai.DefaultHttpxClient(
                               verify=context)) as client:
            model = client.models.list().data[0].id
            done = client.completions.create(model=model, prompt="Paris is", max_tokens=4,
                                             temperature=0)
        assert done.usage is not None and done.usage.completion_tokens > 0
        with pytest.raises((OSError, http.client.HTTPException)):   # plain HTTP to TLS
            urllib.request.urlopen(f"http://{cluster.procs.http_address}/health", timeout=10)
