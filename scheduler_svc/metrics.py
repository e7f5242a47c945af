"""Prometheus metrics of the scheduler, served over HTTP at /metrics.

Names follow vLLM's where vLLM has the metric (`vllm:` prefix, same units and meaning) so
existing dashboards work; the cluster's own have a `splitserve:` prefix. Two kinds:

- Latencies are histograms observed by the frontend as a request's outputs stream out
  (`RequestTimer`): time to first token, inter-token latency, end-to-end latency, plus
  finished-request and token counters.
- Everything that is state (running / waiting requests, KV usage, prefix-cache counters,
  preemptions, migrations, replicas up) is read at scrape time from one `ClusterStats`
  snapshot (stats.py, the same one ServerInfo answers from), so it is never stale and costs
  nothing between scrapes.
"""

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler_svc.metrics_server import MetricsServer
from scheduler_svc.stats import ClusterStats

log = logging.getLogger(__name__)

# Buckets as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class SchedulerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time to first token in seconds.", labels, registry=r,
                              buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive output tokens in seconds.", labels,
                             registry=r, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency in seconds.", labels, registry=r,
                             buckets=E2E_BUCKETS).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests, by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished "
                                     "requests.", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        self.failed = Counter("splitserve:request_failed", "Requests that ended with an error "
                              "(no replica by their deadline, ...).", labels,
                              registry=r).labels(model_name)

    def attach(self, snapshot: Callable[[], ClusterStats]) -> None:
        """`snapshot`: the cluster's state, taken at each scrape."""
        self.registry.register(_ClusterCollector(snapshot, self.model_name))

    def finished(self, reason: str, num_prompt_tokens: int) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP server on a daemon thread; returns the bound port. It answers
        GET /metrics and nothing else (404), to a few connections at once with read
        timeouts (metrics_server.py)."""
        registry = self.registry

        def render() -> tuple[bytes, str]:
            return generate_latest(registry), CONTENT_TYPE_LATEST

        return MetricsServer(host, port, render).serve_in_background()


class RequestTimer:
    """Per request: observes TTFT, inter-token latency and e2e latency as outputs arrive."""

    __slots__ = ("metrics", "arrival", "last_token")

    def __init__(self, metrics: SchedulerMetrics | None) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last_token: float | None = None

    def tokens(self, num_tokens: int) -> None:
        if self.metrics is None or num_tokens == 0:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last_token)
        self.last_token = now
        self.metrics.generation_tokens.inc(num_tokens)

    def finished(self, reason: str, num_prompt_tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
            self.metrics.finished(reason, num_prompt_tokens)

    def failed(self) -> None:
        if self.metrics is not None:
            self.metrics.failed.inc()


class _ClusterCollector(Collector):
    """State read at scrape time from one snapshot."""

    def __init__(self, snapshot: Callable[[], ClusterStats], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        values = [self.model_name]
        stats = self.snapshot()
        ready, started = stats.ready, stats.started
        running = sum(e.num_running for e in ready)
        waiting = sum(e.num_waiting for e in ready) + stats.num_parked
        used = sum(e.num_usable_blocks - e.num_free_blocks for e in ready)
        total = sum(e.num_usable_blocks for e in ready)
        preemptions = sum(e.num_preemptions for e in started)
        queries = sum(e.num_prompt_tokens_admitted for e in started)
        hits = sum(e.num_cached_tokens_admitted for e in started)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in a running batch.", running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run (including those "
                    "waiting for a ready replica).", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use over ready "
                    "replicas (1 = full).", used / total if total else 0.0)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache.", queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      hits)
        yield counter("vllm:num_preemptions", "Requests preempted (recompute).", preemptions)
        yield counter("splitserve:num_migrations", "Requests moved off a lost replica.",
                      stats.num_migrations)
        yield gauge("splitserve:replicas_up", "Replicas ready to serve.", len(ready))
        yield gauge("splitserve:kvcache_reachable", "1 if kvcache_svc answered the last probe.",
                    1.0 if stats.kv_reachable else 0.0)
        yield from store_metrics(stats, labels, values, counter)


def store_metrics(stats: ClusterStats, labels: list[str], values: list[str],
                  counter: Callable[[str, str, float], CounterMetricFamily]) -> Iterator[Metric]:
    """The KV store's families: admissions (the engines') and the store's own counters and
    tiers (as of membership's last kvcache_svc probe; absent when there is no store)."""
    started = stats.started
    yield counter("splitserve:kv_store_hit_tokens", "Prompt tokens admitted as loads from the "
                  "KV store.", sum(e.num_store_hit_tokens for e in started))
    yield counter("splitserve:kv_store_miss_tokens", "Prompt tokens admitted that neither the "
                  "prefix cache nor the KV store held.",
                  sum(e.num_store_miss_tokens for e in started))
    yield counter("splitserve:kv_store_loaded_tokens", "Tokens every rank loaded from the KV "
                  "store.", sum(e.num_store_loaded_tokens for e in started))
    yield counter("splitserve:kv_store_load_fallbacks", "Loads that came back short; the rest "
                  "was recomputed.", sum(e.num_store_load_fallbacks for e in started))
    store = stats.kv_store
    if store is None:
        return
    yield counter("splitserve:kv_store_stored_tokens", "Tokens of KV newly stored.",
                  store.num_stored_tokens)
    yield counter("splitserve:kv_store_stored_bytes", "Bytes of KV newly stored.",
                  store.num_stored_bytes)
    yield counter("splitserve:kv_store_loaded_bytes", "Bytes of KV served to loads.",
                  store.num_loaded_bytes)
    yield counter("splitserve:kv_store_saves_skipped", "Chunks workers did not save: their "
                  "save queue was full.", sum(w.num_kv_saves_skipped for r in stats.replicas
                                                for w in r.workers))
    chunks = GaugeMetricFamily("splitserve:kv_store_tier_chunks", "Chunks held per tier.",
                               labels=[*labels, "tier"])
    used = GaugeMetricFamily("splitserve:kv_store_tier_bytes", "Bytes used per tier.",
                             labels=[*labels, "tier"])
    for tier in store.tiers:
        chunks.add_metric([*values, tier.name], tier.num_chunks)
        used.add_metric([*values, tier.name], tier.num_bytes)
    yield chunks
    yield used
