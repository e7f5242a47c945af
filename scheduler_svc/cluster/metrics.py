"""Prometheus metrics of the scheduler, served by its cluster process over HTTP at /metrics.

Names follow vLLM's where vLLM has the metric (`vllm:` prefix, same units and meaning) so
existing dashboards work; the cluster's own have a `splitserve:` prefix. Two kinds:

- Latencies and request counters are observed by the front ends as each request's outputs
  stream out (scheduler_svc.frontend.metrics); every front-end process writes them to
  prometheus_client's multiprocess files in `multiprocess_dir`, and a scrape sums them.
- Everything that is state (running / waiting requests, KV usage, prefix-cache counters,
  preemptions, migrations, replicas up) is read at scrape time from one snapshot of the
  cluster's statistics (stats.py, the same one ServerInfo answers from), so it costs nothing
  between scrapes.
"""

import logging
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from scheduler_svc.cluster.metrics_server import MetricsServer
from scheduler_svc.cluster.wire import ClusterStatsReply, ready_engines, started_engines

log = logging.getLogger(__name__)


class ClusterMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], ClusterStatsReply],
                 multiprocess_dir: str | None) -> None:
        """`snapshot`: the cluster's statistics, taken at each scrape; `multiprocess_dir`:
        where the front ends write their request metrics (None: none)."""
        self.registry = CollectorRegistry()
        self.registry.register(_ClusterCollector(snapshot, model_name))
        # This process's own (process_*, python_*), as vLLM's /metrics has its server's.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        if multiprocess_dir is not None:
            MultiProcessCollector(self.registry, path=multiprocess_dir)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP server on a daemon thread; returns the bound port. It answers
        GET /metrics and nothing else (404), to a few connections at once with read
        timeouts (metrics_server.py)."""
        registry = self.registry

        def render() -> tuple[bytes, str]:
            return generate_latest(registry), CONTENT_TYPE_LATEST

        return MetricsServer(host, port, render).serve_in_background()


class _ClusterCollector(Collector):
    """State read at scrape time from one snapshot."""

    def __init__(self, snapshot: Callable[[], ClusterStatsReply], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        values = [self.model_name]
        stats = self.snapshot()
        ready = ready_engines(stats)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield counter("splitserve:num_migrations", "Requests moved off a lost replica.",
                      stats.num_migrations)
        yield gauge("splitserve:replicas_up", "Replicas ready to serve.", len(ready))
        yield gauge("splitserve:kvcache_reachable", "1 if kvcache_svc answered the last probe.",
                    1.0 if stats.kv_reachable else 0.0)
        yield from store_metrics(stats, labels, values, counter)
        yield from engine_metrics(stats, self.model_name)


def engine_metrics(stats: ClusterStatsReply, model_name: str) -> Iterator[Metric]:
    """vLLM's per-engine families, labelled `engine` (the replica id) as vLLM labels its
    engine cores': ready replicas' load and KV use, started ones' counters. Requests parked
    in the front ends (on no replica yet) wait under engine "none"."""
    labels = ["model_name", "engine"]
    replicas = [(str(r.replica_id), r.state == "ready", r.engine) for r in stats.replicas
                if r.engine is not None]
    families = {
        "vllm:num_requests_running": GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in the replica's running batch.",
            labels=labels),
        "vllm:num_requests_waiting": GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting to run (engine \"none\": for a "
            "replica).", labels=labels),
        "vllm:kv_cache_usage_perc": GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "Fraction of the replica's KV blocks in use (1 = full).",
            labels=labels),
        # vLLM's older name of the same, which its reference dashboard reads.
        "vllm:gpu_cache_usage_perc": GaugeMetricFamily(
            "vllm:gpu_cache_usage_perc", "Fraction of the replica's KV blocks in use (1 = full).",
            labels=labels),
        "vllm:prefix_cache_queries": CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            labels=labels),
        "vllm:prefix_cache_hits": CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
            labels=labels),
        "vllm:num_preemptions": CounterMetricFamily(
            "vllm:num_preemptions", "Requests preempted (recomputed later).",
            labels=labels),
    }
    for engine, ready, e in replicas:
        values = [model_name, engine]
        if ready:
            usage = ((e.num_usable_blocks - e.num_free_blocks) / e.num_usable_blocks
                     if e.num_usable_blocks else 0.0)
            families["vllm:num_requests_running"].add_metric(values, e.num_running)
            families["vllm:num_requests_waiting"].add_metric(values, e.num_waiting)
            families["vllm:kv_cache_usage_perc"].add_metric(values, usage)
            families["vllm:gpu_cache_usage_perc"].add_metric(values, usage)
        families["vllm:prefix_cache_queries"].add_metric(values, e.num_prompt_tokens_admitted)
        families["vllm:prefix_cache_hits"].add_metric(values, e.num_cached_tokens_admitted)
        families["vllm:num_preemptions"].add_metric(values, e.num_preemptions)
    families["vllm:num_requests_waiting"].add_metric([model_name, "none"], stats.num_parked)
    yield from families.values()


def store_metrics(stats: ClusterStatsReply, labels: list[str], values: list[str],
                  counter: Callable[[str, str, float], CounterMetricFamily]) -> Iterator[Metric]:
    """The KV store's families: admissions (the engines') and the store's own counters and
    tiers (as of membership's last kvcache_svc probe; absent when there is no store)."""
    started = started_engines(stats)
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
