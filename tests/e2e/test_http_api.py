"""The OpenAI-compatible HTTP API (http_svc) as a process beside the real services, driven with
the official `openai` client where it can be: greedy completions and chats token-exact with
the gRPC API's for the same prompt, plain and streamed (with include_usage); both logprobs
shapes; /tokenize and /detokenize round trips; errors (400 naming the field, 404 for another
model, 503 while no replica can serve); and a client that disconnects aborts its request in
the scheduler. Two clusters: one with a worker, one with none (the 503s)."""

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from services.launcher import ClusterSpec, ServiceProcesses
from services.rpc.splitserve.v1 import generation_pb2 as pb
from tests.e2e.harness import RunningCluster, free_ports, run_cluster, wait_for

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


def get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_for_http(base: str, status: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            if (last := get(f"{base}/health", timeout=2)[0]) == status:
                return
        except OSError as exc:    # not listening yet
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"/health never answered {status}: last {last}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("http"), http=True) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


@pytest.fixture(scope="module")
def base(cluster: RunningCluster) -> str:
    return f"http://{cluster.procs.http_address}"


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    # No retries: a 503 must reach the test as it was answered.
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(cluster: RunningCluster) -> str:
    return str(cluster.stub.ModelInfo(pb.ModelInfoRequest()).model)


def grpc_once(cluster: RunningCluster, max_tokens: int, **prompt: Any) -> pb.GenerateResponse:
    return cluster.stub.GenerateOnce(pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens), **prompt),
        timeout=120)


def test_models_health_and_version(client: openai.OpenAI, base: str, model: str,
                                   cluster: RunningCluster) -> None:
    (card,) = client.models.list().data
    assert card.id == model and card.object == "model"
    info = cluster.stub.ModelInfo(pb.ModelInfoRequest())
    assert card.model_extra is not None and card.model_extra["max_model_len"] == \
        info.max_model_len
    assert get(f"{base}/health") == (200, b"")
    status, body = get(f"{base}/version")
    assert status == 200 and json.loads(body)["version"]


def test_completions_equal_the_grpc_api_plain_and_streamed(
        client: openai.OpenAI, cluster: RunningCluster, model: str) -> None:
    reference = grpc_once(cluster, 12, text=PROMPT)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    (choice,) = plain.choices
    assert choice.text == reference.text and choice.finish_reason == "length"
    assert plain.id.startswith("cmpl-") and plain.object == "text_completion"
    assert plain.usage is not None
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens,
            plain.usage.total_tokens) == (reference.usage.prompt_tokens, 12,
                                          reference.usage.prompt_tokens + 12)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == reference.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage == plain.usage
    # Token ids in, and the default max_tokens of 16 (OpenAI's and vLLM's).
    ids = list(cluster.stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids)
    by_ids = client.completions.create(model=model, prompt=ids, temperature=0)
    assert by_ids.choices[0].text == grpc_once(cluster, 16, text=PROMPT).text


def test_chat_equals_the_grpc_api_plain_and_streamed(
        client: openai.OpenAI, cluster: RunningCluster, model: str) -> None:
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    reference = grpc_once(cluster, 10, chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="system", content="Answer briefly."),
        pb.ChatMessage(role="user", content=QUESTION)]))
    plain = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                           max_completion_tokens=10, temperature=0)
    (choice,) = plain.choices
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    assert choice.finish_reason == reference.finish_reason
    assert plain.usage is not None and plain.usage.prompt_tokens == \
        reference.usage.prompt_tokens
    stream = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        reference.text
    assert stream[-1].choices == [] and stream[-1].usage == plain.usage
    # Without a limit the reply may fill the context; this one ends at EOS.
    unlimited = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0)
    assert unlimited.choices[0].finish_reason == "stop"


def test_logprobs_shapes(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                           temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs or []) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs or [], lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == logprob      # greedy: the best one
        assert max(top.values()) == logprob
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token            # greedy
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_tokenize_and_detokenize_round_trip(base: str, cluster: RunningCluster,
                                            model: str) -> None:
    text = "Hello, wörld! 12"
    status, tokens = post(f"{base}/tokenize", {"model": model, "prompt": text})
    assert status == 200
    assert tokens["tokens"] == list(cluster.stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    assert post(f"{base}/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": text})
    status, chat = post(f"{base}/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    header = post(f"{base}/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                       "add_generation_prompt": False})[1]
    assert status == 200 and chat["tokens"][:header["count"]] == header["tokens"]
    assert chat["count"] > header["count"]


def test_errors_name_the_field(client: openai.OpenAI, base: str, model: str) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"suffix": "tail"}, "suffix", "suffix is not supported"),
        ({"n": 0}, "n", "n must be in [1, 64]"),
        ({"temperature": -1}, "temperature", "temperature must be >= 0"),
        ({"max_tokens": 100_000}, "max_tokens", "exceeds the model's context"),
    ]
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model, prompt=PROMPT, **fields)
        assert refused.value.param == param and message in refused.value.message, fields
    # Neutral values of what the engine lacks are accepted; `user` is ignored, and so are
    # unknown fields (as vLLM: with a warning, tests/e2e/test_http_tools.py).
    client.completions.create(model=model, prompt=PROMPT, max_tokens=1, presence_penalty=0,
                              frequency_penalty=0, n=1, user="someone", extra_body={"foo": 1})
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "http://x/y.png"}}]}])
    assert refused.value.param == "messages[0].content[0].type"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"chat_template": "{{ 'x' }}"})
    assert refused.value.param == "chat_template"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert missing.value.status_code == 404 and missing.value.param == "model"
    status, body = get(f"{base}/v1/no-such-path")
    assert status == 404 and json.loads(body)["error"]["code"] == 404


def live_requests(cluster: RunningCluster) -> int:
    info = cluster.stub.ServerInfo(pb.ServerInfoRequest())
    return sum(r.num_running + r.num_waiting for r in info.replicas)


def wait_until(check: Any, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def long_completion(cluster: RunningCluster, stream: bool) -> http.client.HTTPConnection:
    """A 4,000-token completion sent on a raw connection (its caller cuts it off)."""
    host, port = cluster.procs.http_address.rsplit(":", 1)  # type: ignore[union-attr]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
                       "temperature": 0, "stream": stream})
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    return connection


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request(cluster: RunningCluster, base: str,
                                                      stream: bool) -> None:
    connection = long_completion(cluster, stream)
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")     # generating
    assert wait_until(lambda: live_requests(cluster) == 1), "the request never ran"
    assert wait_until(lambda: any(p.num_used_blocks for p in cluster.kv_stats().pools))
    connection.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    connection.close()
    assert wait_until(lambda: live_requests(cluster) == 0), "still running after disconnect"
    assert wait_until(lambda: all(p.num_used_blocks == 0 for p in cluster.kv_stats().pools))


def test_no_replica_is_503(tmp_path: Path) -> None:
    """A scheduler with no worker: the API is up, knows its model, and refuses generation with
    503 at once (instead of waiting for a replica)."""
    port, control, plan, admin, events, store, metrics, http_port = free_ports(8)
    spec = ClusterSpec(port=port, control_port=control, kv_plan_port=plan, kv_admin_port=admin,
                       kv_events_port=events, kv_store_port=store, metrics_port=metrics,
                       http_port=http_port, num_replicas=0)
    procs = ServiceProcesses(spec, tmp_path)
    procs.start()
    try:
        base = f"http://127.0.0.1:{http_port}"
        with grpc.insecure_channel(procs.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        wait_for_http(base, 503)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        # /health is 503 too while the front end has not reached the scheduler yet: the model
        # list says it has (the card is the scheduler's).
        assert wait_for(lambda: get(f"{base}/v1/models", timeout=2)[0] == 200, 30)
        (card,) = client.models.list().data
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=card.id, prompt=PROMPT, max_tokens=4)
        assert refused.value.status_code == 503 and time.monotonic() - start < 5
        status, body = post(f"{base}/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "Hi"}], "stream": True})
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    finally:
        codes = procs.stop()
    assert codes == {"http": 0, "scheduler": 0, "kvcache": 0}, codes
