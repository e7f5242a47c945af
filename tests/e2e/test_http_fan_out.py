"""Bounded fan-out through the real services (issue 40, point 2): a completions request past
--max-prompts-per-request is a 400 naming `prompt`, sent nowhere; with the cap raised, a
request of FAN_OUT_PROMPTS prompts (one scheduler request each) is served while a control
client's short greedy completions each finish within 2 s and a control stream in flight is
never cancelled; http_svc's memory comes back afterwards and no log holds a traceback.

Before, http_svc opened every prompt's gRPC call at once: past the backlog of calls the
scheduler's gRPC server holds before its servicer takes them (grpc.server.max_pending_requests,
about 1,000 to 3,000), gRPC cancelled calls, whoever made them, and a client in flight at
that moment got a 500 CANCELLED. Now at most MAX_CALLS_IN_FLIGHT of one request's calls are
open at once. A control beside the fan-out still waits for CPU: on a quiet 2-core machine
it answers in well under 2 s, on a loaded one (other jobs) a few seconds at worst, so the 2 s
bound is asserted on the median and a stall bound on the worst case."""

import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from http_svc.outputs import MAX_CALLS_IN_FLIGHT
from tests.e2e.harness import RunningCluster, run_cluster
from tests.e2e.test_http_api import PROMPT, post, wait_for_http
from tests.e2e.test_http_faults import live_requests, rss_mib

pytestmark = pytest.mark.e2e

CAP = 2000
FAN_OUT_PROMPTS = 600
RSS_MARGIN_MIB = 40.0
STALL_BOUND_S = 8.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("http-fan-out"), http=True,
                     env={"SPLITSERVE_HTTP_MAX_PROMPTS_PER_REQUEST": str(CAP)}) as running:
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


def test_no_traceback_in_the_logs(cluster: RunningCluster) -> None:
    logs = {p.name: p.read_text() for p in Path(cluster.log_dir).glob("*.log")}
    assert logs
    assert not [name for name, text in logs.items() if "Traceback" in text]
