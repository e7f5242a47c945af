"""Hostile sizes at the front door (issue 40, point 3), through the real services: JSON nested
100,000 deep (as the body, in a message's content, as a response_format schema, as
guided_json text) and fields a million long (stop_token_ids, guided_choice, an enum, stop
strings, a cache salt) each get a 400 naming the field and the limit, never a 500 or a
429; the native gRPC API answers the same with INVALID_ARGUMENT naming the field. While each
case runs, a control client's short greedy completion finishes within 2 s; afterwards the HTTP
front end's and the scheduler front end's memory and threads are back near where they were,
and no log holds a traceback.

Where a control's time goes (measured, alternating rounds of the code before and after
http_svc.request_body moved large bodies off the loop, on the shared 2-core machine at a load
average of 7-9): with no hostile request at all a control takes 0.1-3.0 s there; the cases
stall http_svc's loop (the slowest GET /version while each runs) by at most 0.7 s before and
0.35 s after (the 10 MB enum: json.loads, then the schema's json.dumps in sampling); none
reaches the scheduler. Hence the bound's allowance for the machine's own load."""

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from scheduler_svc.frontend.prompts import TOKENIZER_THREADS
from services.rpc.splitserve.v1 import generation_pb2 as pb
from tests.e2e.harness import RunningCluster, run_cluster
from tests.e2e.test_http_api import PROMPT, wait_for_http

pytestmark = pytest.mark.e2e

CONTROL_LIMIT_S = 2.0
DEEP = 100_000
TOO_DEEP = "request body nested deeper than 128 levels"
# What the cases may leave behind. Measured (VmRSS and VmHWM from /proc, 1 s after the cases,
# 3 runs of this file on the shared 2-core machine): http_svc peaked ~100 MiB over its 77 MiB
# and kept 12-22 MiB of it (allocator fragments; running every HTTP case 4 times over kept
# the same 13-15 MiB: it does not grow), the scheduler's front end kept 8.6 MiB. Twice the
# most seen; one 10 MB body kept alive would add ~100 MiB.
MEMORY_MARGIN_MIB = 48
# Threads a pool starts on demand: the front end's tokenizer pool (TOKENIZER_THREADS, 2) has
# one after sequential requests, and may start its second when two prompts are tokenized at
# once (measured: 17 threads before, 18 after in one run of 3). http_svc's own pools are
# started with it.
THREAD_MARGINS = {"http_svc": 0, "frontend": TOKENIZER_THREADS - 1}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("hostile-sizes"), http=True) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


def proc_status(pid: int) -> tuple[float, int, float]:
    """A process's resident memory and its peak (MiB), and its number of threads, from
    /proc."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines())
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"]),
            int(fields["VmHWM"].split()[0]) / 1024)


def watched(cluster: RunningCluster) -> dict[str, int]:
    """The processes the hostile cases reach: the HTTP front end and the scheduler's front
    end (a child of the scheduler process)."""
    scheduler = cluster.procs.procs["scheduler"].pid
    children = Path(f"/proc/{scheduler}/task/{scheduler}/children").read_text().split()
    frontends = [int(c) for c in children
                 if b"scheduler_svc.frontend" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(frontends) == 1, frontends
    return {"http_svc": cluster.procs.procs["http"].pid, "frontend": frontends[0]}


@pytest.fixture(scope="module", autouse=True)
def before(cluster: RunningCluster) -> dict[str, tuple[float, int, float]]:
    """Memory and threads before the first case, once the first requests' one-time costs
    (imports, channels) are paid."""
    for _ in range(3):
        control(cluster)
    time.sleep(1)
    return {name: proc_status(pid) for name, pid in watched(cluster).items()}


def send(cluster: RunningCluster, path: str, data: bytes, timeout: float = 60,
         ) -> tuple[int, Any]:
    host, port = cluster.procs.http_address.rsplit(":", 1)  # type: ignore[union-attr]
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("POST", path, data, {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def control(cluster: RunningCluster) -> float:
    """Seconds a short greedy completion takes; it must succeed."""
    start = time.monotonic()
    status, body = send(cluster, "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode())
    assert status == 200, body
    return time.monotonic() - start


def while_running(cluster: RunningCluster, hostile: Any) -> tuple[Any, float]:
    """`hostile()`'s result, and the slowest of the control completions sent while it ran
    (at least one)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(hostile()))
    thread.start()
    slowest = 0.0
    while True:
        slowest = max(slowest, control(cluster))
        if not thread.is_alive():
            break
    thread.join()
    return result[0], slowest


def assert_not_stalled(cluster: RunningCluster, slowest: float) -> None:
    """Within CONTROL_LIMIT_S; on a machine so loaded that a control completion alone takes
    a while (the suite shares its cores), within that much more."""
    if slowest < CONTROL_LIMIT_S:
        return
    idle = max(control(cluster) for _ in range(3))
    assert slowest < CONTROL_LIMIT_S + idle, (
        f"the control completion took {slowest:.2f} s ({idle:.2f} s with nothing else)")


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def chat(content: str, more: str = "") -> bytes:
    return ('{"messages": [{"role": "user", "content": ' + content + '}], "max_tokens": 2'
            + more + "}").encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"prompt": PROMPT, "max_tokens": 2, **fields}).encode()


ENUM_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "string", "enum": [str(i) for i in range(1_000_000)]}}}

# (path, body, the param the error names, a text its message holds)
CASES = {
    "deep body": ("/v1/completions", nested(DEEP).encode(), None, TOO_DEEP),
    "deep message content": ("/v1/chat/completions", chat(nested(DEEP)), None, TOO_DEEP),
    "deep json_schema": ("/v1/chat/completions", chat('"hi"', (
        ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
        '"schema": {"a": ' + nested(DEEP) + "}}}")), None, TOO_DEEP),
    "deep guided_json text": ("/v1/completions", completion(guided_json=nested(DEEP)),
                              "guided_json", "nested deeper than 128 levels"),
    "stop_token_ids": ("/v1/completions", completion(stop_token_ids=[1] * 1_000_000),
                       "stop_token_ids", "1024"),
    "guided_choice": ("/v1/completions", completion(guided_choice=["a"] * 1_000_000),
                      "guided_choice", "1024"),
    "enum": ("/v1/chat/completions", chat('"hi"', ', "response_format": '
                                          + json.dumps(ENUM_SCHEMA)),
             "response_format", "65536"),
    "stop strings": ("/v1/completions", completion(stop=["s"] * 1_000_000), "stop", "16"),
    "stop string": ("/v1/completions", completion(stop="s" * 1_000_000), "stop", "256"),
    "guided_regex": ("/v1/completions", completion(guided_regex="a" * 1_000_000),
                     "guided_regex", "16384"),
    "cache_salt": ("/v1/completions", completion(cache_salt="c" * 1_000_000), "cache_salt",
                   "256"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_http_case_is_a_400_naming_the_field(cluster: RunningCluster, case: str) -> None:
    path, data, param, text = CASES[case]
    (status, body), slowest = while_running(cluster, lambda: send(cluster, path, data))
    error = body["error"]
    assert (status, error["param"]) == (400, param), error
    assert text in error["message"], error
    assert_not_stalled(cluster, slowest)


def grpc_request(**sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2, **sampling))


def tools_chat(tools_json: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hi")], tools_json=tools_json),
        sampling=pb.SamplingParams(max_tokens=2))


GRPC_CASES = {
    "stop_token_ids": (grpc_request(stop_token_ids=[1] * 500_000),
                       "stop_token_ids has 500000 ids; at most 1024"),
    "stop strings": (grpc_request(stop=["s"] * 100_000), "stop has 100000 strings; at most 16"),
    "stop string": (grpc_request(stop=["s" * 500_000]), "stop[0] is 500000 characters"),
    "logit_bias": (grpc_request(logit_bias={i: 1.0 for i in range(50_000)}),
                   "logit_bias has 50000 entries; at most 1024"),
    "deep tools_json": (tools_chat("[" + nested(DEEP) + "]"),
                        "tools_json is nested deeper than 128 levels"),
    "tools_json past the limit": (tools_chat('[{"a": ' + nested(500) + "}]"),
                                  "tools_json is nested deeper than 128 levels"),
}


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_case_is_invalid_argument_naming_the_field(cluster: RunningCluster,
                                                        case: str) -> None:
    request, text = GRPC_CASES[case]

    def hostile() -> grpc.RpcError | None:
        try:
            cluster.stub.GenerateOnce(request, timeout=60)
        except grpc.RpcError as exc:
            return exc
        return None

    error, slowest = while_running(cluster, hostile)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert text in error.details()
    assert_not_stalled(cluster, slowest)


def test_an_unknown_model_name_is_not_echoed_whole(cluster: RunningCluster) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        cluster.stub.GenerateOnce(pb.GenerateRequest(text=PROMPT, model="m" * 1_000_000,
                                                     sampling=pb.SamplingParams(max_tokens=2)),
                                  timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1000000 characters" in raised.value.details()
    assert len(raised.value.details()) < 1000


def test_memory_and_threads_come_back(cluster: RunningCluster,
                                      before: dict[str, tuple[float, int, float]]) -> None:
    """After every case above (eleven bodies of up to 10 MB, six gRPC requests of up to
    3 MB): each process holds at most MEMORY_MARGIN_MIB more than before them, and no more
    threads than its pools may start on demand."""
    control(cluster)
    time.sleep(1)
    after = {name: proc_status(pid) for name, pid in watched(cluster).items()}
    print(f"(RSS MiB, threads, peak RSS MiB) before -> after: {before} -> {after}")
    for name, (rss, threads, _) in after.items():
        assert rss - before[name][0] < MEMORY_MARGIN_MIB, (name, before[name], after[name])
        assert threads <= before[name][1] + THREAD_MARGINS[name], (name, before[name],
                                                                   after[name])


def test_no_traceback_in_the_logs(cluster: RunningCluster) -> None:
    """Runs last in this file: every case above was the client's mistake."""
    logs = {p.name: p.read_text(errors="replace") for p in cluster.log_dir.glob("*.log")}
    assert logs
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
