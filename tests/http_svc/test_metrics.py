"""/metrics on the HTTP port (http_svc.metrics): the HTTP requests served (by route template,
method and status class; sizes; durations), this process's collectors, and the scheduler's
families passed through from its metrics port, less the ones this process has itself."""

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from http_svc.__main__ import parse_config
from http_svc.app import build_app
from http_svc.config import HttpConfig
from http_svc.metrics import scheduler_url, without_own_families
from scheduler_svc.cluster.metrics_server import MetricsServer

SCHEDULER_TEXT = """# HELP process_cpu_seconds_total the scheduler's
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 123.0
# HELP vllm:num_requests_running running
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# HELP python_info the scheduler's python
# TYPE python_info gauge
python_info{implementation="CPython"} 1.0
"""


@pytest.fixture
def scheduler() -> Iterator[str]:
    server = MetricsServer("127.0.0.1", 0, lambda: (SCHEDULER_TEXT.encode(), "text/plain"))
    port = server.serve_in_background()
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    server.server_close()


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Family name -> its samples' labels and values; a counter's or summary's are only its
    _total, _sum and _count samples (not _created)."""
    return {f.name: [(s.labels, s.value) for s in f.samples if not s.name.endswith("_created")]
            for f in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels: str) -> float:
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"no {name}{labels}")


def requests_total(text: str) -> dict[tuple[str, str, str], float]:
    return {(labels["handler"], labels["method"], labels["status"]): value
            for labels, value in families(text)["http_requests"]}


def test_requests_are_counted_by_route_and_the_scheduler_is_served_again(
        scheduler: str) -> None:
    client = TestClient(build_app(HttpConfig(scheduler_metrics=scheduler)))
    version = client.get("/version")
    client.get("/version")
    assert client.get("/no/such/path").status_code == 404
    assert client.post("/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"}).status_code == 400
    reply = client.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    text = reply.text
    counts = requests_total(text)
    assert counts[("/version", "GET", "2xx")] == 2
    assert counts[("none", "GET", "4xx")] == 1
    assert counts[("/v1/completions", "POST", "4xx")] == 1
    assert not any(handler == "/metrics" for handler, _, _ in counts)   # scrapes: not traffic
    got = families(text)
    assert sample(text, "http_response_size_bytes_sum", handler="/version") == \
        2 * len(version.content)
    assert sample(text, "http_response_size_bytes_count", handler="/version") == 2
    assert sample(text, "http_request_size_bytes_sum", handler="/v1/completions") == 9
    assert sample(text, "http_request_duration_highr_seconds_count") == 4
    assert sample(text, "http_request_duration_seconds_count", handler="/v1/completions",
                  method="POST") == 1
    # The scheduler's families pass through; its process_* and python_* do not (ours are).
    assert got["vllm:num_requests_running"] == [({"engine": "0", "model_name": "tiny"}, 2.0)]
    assert text.count("# TYPE process_cpu_seconds_total") == 1
    assert text.count("# TYPE python_info") == 1
    assert got["process_cpu_seconds"][0][1] != 123.0
    assert got["splitserve:scheduler_metrics_up"][0][1] == 1


def test_a_silent_scheduler_costs_only_its_families(scheduler: str) -> None:
    closed = TestClient(build_app(HttpConfig(scheduler_metrics="http://127.0.0.1:9/metrics")))
    reply = closed.get("/metrics")
    assert reply.status_code == 200
    got = families(reply.text)
    assert got["splitserve:scheduler_metrics_up"][0][1] == 0
    assert not any(name.startswith("vllm:") for name in got)
    assert "process_cpu_seconds" in got
    own_only = TestClient(build_app(HttpConfig(scheduler_metrics="off")))
    assert "vllm:" not in own_only.get("/metrics").text


def test_where_the_scheduler_metrics_are_read() -> None:
    assert scheduler_url("", "sched.local:50051", 50056) == "http://sched.local:50056/metrics"
    assert scheduler_url("off", "sched.local:50051", 50056) is None
    assert scheduler_url("http://m:9/metrics", "x:1", 50056) == "http://m:9/metrics"
    with pytest.raises(ValueError, match="--scheduler-metrics"):
        scheduler_url("m:9/metrics", "x:1", 50056)


def test_the_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config(["--scheduler-metrics", "http://m:1/metrics"]).scheduler_metrics == \
        "http://m:1/metrics"
    with pytest.raises(SystemExit):
        parse_config(["--scheduler-metrics", "m:1"])
    assert "--scheduler-metrics" in capsys.readouterr().err


def test_own_families_are_dropped_whole() -> None:
    kept = without_own_families(SCHEDULER_TEXT)
    assert "process_" not in kept and "python_" not in kept
    assert kept.splitlines() == SCHEDULER_TEXT.splitlines()[3:6]
