"""HTTP hygiene through the real services (issue 40, point 4): 20 half-sent requests are
answered 408 and closed after the read timeout (10 s, the default) while a control client's
greedy completion finishes within 2 s; connections past --max-connections get 503 while one
below the cap is served; a body not declared JSON gets 415 (and the OpenAI client's requests
pass); CORS is off by default and follows --allowed-origins. The front end's threads and memory
come back and its log holds no traceback.

The cluster's own front end runs with the defaults; a second one, started beside it on the same
scheduler, has a small connection cap and an origin allow-list."""

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.rpc.splitserve.v1 import generation_pb2 as pb
from tests.e2e.harness import RunningCluster, free_ports, run_cluster
from tests.e2e.test_http_api import PROMPT, wait_for_http

pytestmark = pytest.mark.e2e

READ_TIMEOUT_S = 10.0           # http_svc's default --request-read-timeout
CONTROL_S = 2.0                 # the control client's greedy completion, at most
MAX_CONNECTIONS = 8             # the second front end's --max-connections
ORIGIN = "https://page.example"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("http-hygiene"), http=True) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


@pytest.fixture(scope="module")
def model(cluster: RunningCluster) -> str:
    return str(cluster.stub.ModelInfo(pb.ModelInfoRequest()).model)


@pytest.fixture(scope="module")
def second(cluster: RunningCluster) -> Iterator[tuple[str, Path]]:
    """A second front end on the same scheduler: (host:port, its log)."""
    port = free_ports(1)[0]
    log = cluster.log_dir / "http2.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "http_svc", "--port", str(port),
             "--scheduler", cluster.procs.address, "--scheduler-metrics", "off",
             "--max-connections", str(MAX_CONNECTIONS), "--allowed-origins", ORIGIN],
            env=cluster.procs.child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_http(f"http://127.0.0.1:{port}", 200)
        yield f"127.0.0.1:{port}", log
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        assert "Traceback" not in log.read_text()


def split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def http_pid(cluster: RunningCluster) -> int:
    return cluster.procs.procs["http"].pid


def proc_status(pid: int, field: str) -> int:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(field + ":"))
    return int(line.split()[1])


def raw_post(address: str, path: str, body: bytes, headers: dict[str, str]
             ) -> tuple[int, dict[str, str], bytes]:
    """A POST with exactly these headers (urllib would add a form content type)."""
    connection = http.client.HTTPConnection(*split(address), timeout=60)
    try:
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        return (response.status, {k.lower(): v for k, v in response.getheaders()},
                response.read())
    finally:
        connection.close()


def control(address: str, model: str) -> float:
    """A short greedy completion; its wall time (asserts a 200 with text)."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2,
                       "temperature": 0}).encode()
    start = time.monotonic()
    status, _, reply = raw_post(address, "/v1/completions", body,
                                {"content-type": "application/json"})
    took = time.monotonic() - start
    assert status == 200 and json.loads(reply)["choices"][0]["text"], reply[:300]
    return took


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_twenty_half_sent_requests_are_closed_while_others_are_served(
        cluster: RunningCluster, model: str) -> None:
    address = cluster.procs.http_address
    assert address is not None
    control(address, model)                                 # warm
    pid = http_pid(cluster)
    num_threads, rss_kib = proc_status(pid, "Threads"), proc_status(pid, "VmRSS")
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2}).encode()
    whole = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
             b"content-length: %d\r\n\r\n%s" % (len(body), body))
    parts = [whole[:40], whole[:-10]] * 10                   # headers cut, body cut
    socks = [socket.create_connection(split(address), timeout=30) for _ in parts]
    start = time.monotonic()
    for sock, part in zip(socks, parts, strict=True):
        sock.sendall(part)
    timings = []
    while time.monotonic() - start < READ_TIMEOUT_S - 2:
        timings.append(control(address, model))
    answers = []
    for sock in socks:
        answers.append(read_until_closed(sock))
        sock.close()
    closed_after = time.monotonic() - start
    assert max(timings) < CONTROL_S, timings
    assert READ_TIMEOUT_S - 1 < closed_after < READ_TIMEOUT_S + 3, closed_after
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert "--request-read-timeout" in json.loads(
            answer.partition(b"\r\n\r\n")[2])["error"]["message"]
    time.sleep(0.5)
    assert proc_status(pid, "Threads") <= num_threads
    assert proc_status(pid, "VmRSS") - rss_kib < 20 << 10          # KiB
    log = (cluster.log_dir / "http.log").read_text()
    assert "Traceback" not in log and " ERROR " not in log
    assert log.count("request not sent within") == 1     # rate-limited: one line, one peer


def test_a_body_not_declared_json_gets_415(cluster: RunningCluster, model: str) -> None:
    address = cluster.procs.http_address
    assert address is not None
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", None):
        headers = {} if content_type is None else {"content-type": content_type}
        status, _, reply = raw_post(address, "/v1/completions", body, headers)
        message = json.loads(reply)["error"]["message"]
        assert status == 415 and (content_type or "no Content-Type") in message, reply
    status, _, _ = raw_post(address, "/v1/chat/completions", json.dumps({
        "model": model, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2}).encode(), {"content-type": "application/json; charset=utf-8"})
    assert status == 200
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="none", max_retries=0)
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices[0].text


def preflight(address: str, origin: str) -> tuple[int, dict[str, str]]:
    host, port = split(address)
    request = urllib.request.Request(f"http://{host}:{port}/v1/completions", method="OPTIONS",
                                     headers={"origin": origin,
                                              "access-control-request-method": "POST",
                                              "access-control-request-headers": "content-type"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}


def test_cors_is_off_by_default_and_follows_the_allow_list(
        cluster: RunningCluster, second: tuple[str, Path]) -> None:
    address = cluster.procs.http_address
    assert address is not None
    status, headers = preflight(address, ORIGIN)
    assert status >= 400 and not [k for k in headers if k.startswith("access-control-")]
    status, headers = preflight(second[0], ORIGIN)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers = preflight(second[0], "https://other.example")
    assert status == 400 and "access-control-allow-origin" not in headers


def test_connections_past_the_cap_get_503_and_one_below_is_served(
        second: tuple[str, Path], model: str) -> None:
    address, log = second
    held = [socket.create_connection(split(address), timeout=30)
            for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        refused: list[dict[str, Any]] = []
        for _ in range(3):
            with socket.create_connection(split(address), timeout=30) as over:
                over.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
                answer = read_until_closed(over)
            assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
            refused.append(json.loads(answer.partition(b"\r\n\r\n")[2])["error"])
        assert all("--max-connections" in e["message"] for e in refused)
        held.pop().close()
        time.sleep(0.3)
        assert control(address, model) < CONTROL_S          # below the cap: served
    finally:
        for sock in held:
            sock.close()
    text = log.read_text()
    assert text.count(f"over the cap of {MAX_CONNECTIONS}") == 1    # rate-limited
