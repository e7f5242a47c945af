"""The metrics a vLLM dashboard reads, from the real services: after a streamed and a
non-streamed completion over the HTTP API, both /metrics endpoints (the scheduler's metrics
port and the HTTP port) are scraped, and every query of vLLM's reference Grafana dashboard
(examples/online_serving/prometheus_grafana/grafana.json in vLLM; its queries are listed
below, in our words) finds its series for the served model, with sane values. A
non-streamed request's time to first token is when its first token was made, well before
its reply."""

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness import RunningCluster, run_cluster, wait_for
from tests.e2e.test_http_api import wait_for_http

pytestmark = pytest.mark.e2e

# The reference dashboard's queries, panel by panel ($model_name: its template variable,
# itself `label_values({__name__=~"vllm:.*"}, model_name)`).
DASHBOARD_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])'
    ' / rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}'
    '[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])'
    ' / rate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}'
    '[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])'
    ' / rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}'
    '[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}'
    '[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}'
    '[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}'
    '[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}'
    '[$__rate_interval])',
]
SELECTOR = re.compile(r'(vllm:[A-Za-z0-9_:]+)\{model_name="\$model_name"\}')
GROUPING = re.compile(r"sum by\((\w+)\)")

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[str, Series]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    series = {(s.name, frozenset(s.labels.items())): float(s.value)
              for family in text_string_to_metric_families(text) for s in family.samples}
    return text, series


def total(series: Series, name: str, **labels: str) -> float:
    """The sum over every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in series.items() if n == name and want <= ls)


def missing_series(series: Series, model: str) -> list[str]:
    """What the dashboard's queries find nothing for in one scrape ($model_name = model)."""
    missing = []
    for query in DASHBOARD_QUERIES:
        groups = set(GROUPING.findall(query))
        for name in SELECTOR.findall(query):
            found = [dict(ls) for n, ls in series if n == name and ("model_name", model) in ls]
            if not found or not all(g in labels for g in groups for labels in found):
                missing.append(f"{name} (by {sorted(groups)}) in {query}")
            elif any("engine" not in labels for labels in found):
                missing.append(f"{name} without the engine label")
    if not any(n.startswith("vllm:") and ("model_name", model) in ls for n, ls in series):
        missing.append("the model_name template variable")
    return missing


def complete(base: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return reply.read()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("metrics"), http=True) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


def test_the_reference_dashboard_finds_every_series(cluster: RunningCluster) -> None:
    base = f"http://{cluster.procs.http_address}"
    scheduler = f"http://127.0.0.1:{cluster.procs.spec.metrics_port}/metrics"
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    common = {"model": model, "prompt": "The capital of France is", "temperature": 0.0,
              "ignore_eos": True}
    streamed = complete(base, {**common, "max_tokens": 8, "stream": True})
    assert streamed.rstrip().endswith(b"data: [DONE]")
    _, before = scrape(scheduler)
    whole = json.loads(complete(base, {**common, "max_tokens": 24}))
    assert whole["usage"]["completion_tokens"] == 24
    _, after = scrape(scheduler)

    for name, series in (("scheduler", after), ("http", scrape(f"{base}/metrics")[1])):
        assert missing_series(series, model) == [], name
        assert total(series, "process_cpu_seconds_total") > 0, name
        assert total(series, "vllm:request_success_total", model_name=model,
                     finished_reason="length") == 2, name
    _, http_series = scrape(f"{base}/metrics")
    assert total(http_series, "http_requests_total", handler="/v1/completions",
                 method="POST", status="2xx") == 2

    def delta(name: str) -> float:
        return total(after, name, model_name=model) - total(before, name, model_name=model)

    # Sane values: two requests of 8 and 24 tokens, done; KV use a fraction.
    assert total(after, "vllm:generation_tokens_total", model_name=model) == 32
    assert total(after, "vllm:e2e_request_latency_seconds_count", model_name=model) == 2
    assert total(after, "vllm:request_prompt_tokens_sum", model_name=model) >= 2 * 5
    assert total(after, "vllm:request_max_num_generation_tokens_sum", model_name=model) == 32
    # The engine's load as of its last report: it reports the request gone soon after.
    assert wait_for(lambda: total(scrape(scheduler)[1], "vllm:num_requests_running",
                                  model_name=model) == 0, 30)
    usage = [v for (n, ls), v in after.items() if n == "vllm:gpu_cache_usage_perc"]
    assert usage and all(0.0 <= v <= 1.0 for v in usage)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert total(after, f"vllm:request_{phase}_time_seconds_count", model_name=model) == 2
    assert delta("vllm:request_prefill_time_seconds_sum") > 0
    # The non-streamed request: its first token came a whole decode before its reply.
    ttft, e2e = delta("vllm:time_to_first_token_seconds_sum"), delta(
        "vllm:e2e_request_latency_seconds_sum")
    decode = delta("vllm:request_decode_time_seconds_sum")
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 23     # one per later step
    assert 0 < ttft < e2e and decode > 0
    assert e2e - ttft >= 0.5 * decode, (ttft, e2e, decode)
    assert delta("vllm:request_inference_time_seconds_sum") >= decode
