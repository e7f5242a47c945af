"""Bounded fan-out through the real services (issue 40, point 2): a completions request past
--max-prompts-per-request is a 400 naming `prompt`, sent nowhere; with the cap raised, a
request of FAN_OUT_PROMPTS prompts (one scheduler request each) is served while a control
client's short greedy completions each finish within 2 s and a control stream in flight is
never cancelled; http_svc's memory comes back afterwards and no log holds a traceback.

Before, http_svc opened every prompt's gRPC call at once: past the backlog of calls the
scheduler's gRPC server holds before its servicer takes them (grpc.server.max_pending_requests,
about 1,000 to 3,000), gRPC cancelled calls, whoever made them, and a client in flight at
that moment got a 500 CANCELLED. Now at most MAX_CALLS_IN_FLIGHT of one request's calls are
open at once. A control beside the fan-out still waits for CPU. With the worker's OpenMP
threads spinning 30,000 iterations before sleeping, the 2-core machine's worst control took
2.7-3.5 s at load 2.4-6 (median 1.1-1.2 s); with 1,000 (worker_svc/process_env.py), 0.8-1.0 s
(median 0.5 s), and 0.35 s at load 1.2-1.9. The 2 s bound is asserted on the median, and
twice that on the worst case, for slower CI machines.

A streamed batch keeps as few calls open as a non-streamed one. On the native gRPC API, a
client that opens FLOOD_CALLS calls at once gets the excess refused (RESOURCE_EXHAUSTED
naming --max-concurrent-calls, set low here) and no call of anyone's is CANCELLED."""

import asyncio
import collections
import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from http_svc.outputs import MAX_CALLS_IN_FLIGHT
from services.rpc.splitserve.v1 import generation_pb2_grpc
from tests.e2e.harness import RunningCluster, greedy_request, run_cluster
from tests.e2e.test_http_api import PROMPT, post, wait_for_http
from tests.e2e.test_http_faults import live_requests, rss_mib

pytestmark = pytest.mark.e2e

CAP = 2000
FAN_OUT_PROMPTS = 600
RSS_MARGIN_MIB = 40.0
STALL_BOUND_S = 4.0
MAX_CALLS = 64          # --max-concurrent-calls here (the default is 8,192)
FLOOD_CALLS = 5000
STREAMED_PROMPTS = 48


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("http-fan-out"), http=True,
                     env={"SPLITSERVE_HTTP_MAX_PROMPTS_PER_REQUEST": str(CAP),
                          "SPLITSERVE_MAX_CONCURRENT_CALLS": str(MAX_CALLS)}) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


@pytest.fixture(scope="module")
def base(cluster: RunningCluster) -> str:
    return f"http://{cluster.procs.http_address}"


def control(base: str, max_tokens: int = 4) -> tuple[int, float, object]:
    start = time.monotonic()
    status, body = post(f"{base}/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True})
    return status, time.monotonic() - start, body


def test_past_the_cap_is_a_400_naming_prompt(cluster: RunningCluster, base: str) -> None:
    status, body = post(f"{base}/v1/completions",
                        {"prompt": ["hi"] * (CAP + 1), "max_tokens": 1})
    assert status == 400, body
    assert body["error"]["param"] == "prompt"
    assert (f"prompt: {CAP + 1} prompts x n 1 is more than --max-prompts-per-request {CAP}"
            in body["error"]["message"])
    assert live_requests(cluster) == 0


def stream_control(base: str, out: dict[str, object]) -> None:
    """A streamed greedy completion of 64 tokens; its events' finish reasons and status."""
    request = urllib.request.Request(
        f"{base}/v1/completions",
        json.dumps({"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                    "stream": True}).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            events = [line[6:] for line in r.read().decode().splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            out["status"] = r.status
            out["finish"] = [c["finish_reason"] for e in events
                             for c in json.loads(e)["choices"] if c["finish_reason"]]
    except Exception as exc:  # noqa: BLE001 - reported by the test
        out["error"] = repr(exc)


def test_a_large_fan_out_starves_and_cancels_no_other_client(cluster: RunningCluster,
                                                             base: str) -> None:
    pid = cluster.procs.procs["http"].pid
    alone = sorted(control(base)[1] for _ in range(5))
    rss_before = rss_mib(pid)

    big: dict[str, object] = {}

    def fan_out() -> None:
        big["reply"] = post(f"{base}/v1/completions",
                            {"prompt": [f"hello {i}" for i in range(FAN_OUT_PROMPTS)],
                             "max_tokens": 2, "temperature": 0}, timeout=240)

    streamed: dict[str, object] = {}
    threads = [threading.Thread(target=fan_out),
               threading.Thread(target=stream_control, args=(base, streamed))]
    threads[0].start()
    time.sleep(0.5)
    threads[1].start()
    latencies, live = [], []
    while threads[0].is_alive():
        status, took, body = control(base)
        assert status == 200, body
        latencies.append(took)
        live.append(live_requests(cluster))
        time.sleep(0.1)
    for thread in threads:
        thread.join()

    status, body = big["reply"]  # type: ignore[misc]
    assert status == 200, str(body)[:500]
    assert len(body["choices"]) == FAN_OUT_PROMPTS
    assert streamed.get("status") == 200 and streamed.get("finish") == ["length"], streamed
    print("alone", [round(t, 2) for t in alone], "beside",
          [round(t, 2) for t in latencies], "live", live, "rss", rss_before)
    # The scheduler never held more of the fan-out than http_svc keeps in flight (the two
    # controls aside), where it used to get every prompt at once.
    assert max(live) <= MAX_CALLS_IN_FLIGHT + 2, live
    # The control typically answers within 2 s, and is never stalled for long. On the shared
    # 2-core CI its worst case follows the machine's load (see the module docstring).
    assert statistics.median(latencies) < 2.0, (alone, latencies)
    assert max(latencies) < STALL_BOUND_S, (alone, latencies)
    deadline = time.monotonic() + 10
    while live_requests(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_requests(cluster) == 0
    rss_after = rss_mib(pid)
    print("rss after", rss_after)
    assert rss_after < rss_before + RSS_MARGIN_MIB, (rss_before, rss_after)


def test_a_streamed_batch_keeps_a_bounded_number_of_calls_open(cluster: RunningCluster,
                                                               base: str) -> None:
    """Before, a streamed batch opened every prompt's call at once (all STREAMED_PROMPTS
    live in the scheduler); now MAX_CALLS_IN_FLIGHT at most, each choice under its index."""
    request = urllib.request.Request(
        f"{base}/v1/completions",
        json.dumps({"prompt": [f"hello {i}" for i in range(STREAMED_PROMPTS)],
                    "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "stream": True}).encode(), {"content-type": "application/json"})
    live: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            live.append(live_requests(cluster))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status == 200
            events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    finally:
        done.set()
        watcher.join()
    texts: dict[int, str] = {}
    for choice in (c for e in events for c in e["choices"]):
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    finished = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    print("live", live)
    assert finished == list(range(STREAMED_PROMPTS))
    assert all(texts[i] for i in range(STREAMED_PROMPTS))
    assert 0 < max(live) <= MAX_CALLS_IN_FLIGHT, live


async def _outcome(call: Any) -> str:
    """"OK" once the stream ends, or the status code's name and details."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"


async def _flood(address: str) -> dict[str, Any]:
    """FLOOD_CALLS Generate calls at once on one channel, while a control client on another
    has two streams in flight and sends a call and a health check every 0.3 s."""
    options = [("grpc.use_local_subchannel_pool", 1)]         # a connection of its own each
    async with grpc.aio.insecure_channel(address, options=options) as flood_channel, \
            grpc.aio.insecure_channel(address, options=options) as control_channel:
        flooder = generation_pb2_grpc.GenerationStub(flood_channel)
        control = generation_pb2_grpc.GenerationStub(control_channel)
        health = health_pb2_grpc.HealthStub(control_channel)
        await flood_channel.channel_ready()
        streams = [control.Generate(greedy_request([1, 2, 3, 4], 48), timeout=120)
                   for _ in range(2)]
        for stream in streams:                       # running before the flood starts
            await stream.read()
        in_flight = [asyncio.ensure_future(_outcome(s)) for s in streams]
        start = time.monotonic()
        flood = [asyncio.ensure_future(_outcome(flooder.Generate(
            greedy_request([5, 6, 7, i % 100], 1), timeout=120)))
            for i in range(FLOOD_CALLS)]
        during, health_s = [], []
        for _ in range(8):
            during.append(asyncio.ensure_future(_outcome(control.Generate(
                greedy_request([1, 2, 3], 2), timeout=120))))
            asked = time.monotonic()
            reply = await health.Check(health_pb2.HealthCheckRequest(
                service="splitserve.v1.Generation"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            health_s.append(round(time.monotonic() - asked, 2))
            await asyncio.sleep(0.3)
        flooded = collections.Counter(await asyncio.gather(*flood))
        return {"flooded": flooded, "flood_s": time.monotonic() - start,
                "in_flight": await asyncio.gather(*in_flight),
                "during": collections.Counter(o.split(":")[0]
                                              for o in await asyncio.gather(*during)),
                "health_s": health_s}


def test_a_flood_of_native_calls_is_refused_and_cancels_no_other_call(
        cluster: RunningCluster) -> None:
    """Before the scheduler's call bound (services.grpc_server.CallLimit), gRPC cancelled
    calls past its own backlog, whoever sent them (5,000 calls: 208 to 466 CANCELLED in
    three runs, the flood lasting 44 to 111 s as 4,096 of them ran); now the flood is
    refused in about 7 s."""
    seen = asyncio.run(_flood(cluster.procs.address))
    print({k: dict(v) if isinstance(v, collections.Counter) else v for k, v in seen.items()})
    refusal = (f"RESOURCE_EXHAUSTED: this server already serves {MAX_CALLS} calls at once "
               "(--max-concurrent-calls); try again later")
    assert set(seen["flooded"]) <= {"OK", refusal}, seen["flooded"]
    assert seen["flooded"][refusal] > FLOOD_CALLS // 2
    assert seen["in_flight"] == ["OK", "OK"]
    assert set(seen["during"]) <= {"OK", "RESOURCE_EXHAUSTED"}, seen["during"]
    assert live_requests(cluster) == 0


def test_no_traceback_in_the_logs(cluster: RunningCluster) -> None:
    logs = {p.name: p.read_text() for p in Path(cluster.log_dir).glob("*.log")}
    assert logs
    assert not [name for name, text in logs.items() if "Traceback" in text]
