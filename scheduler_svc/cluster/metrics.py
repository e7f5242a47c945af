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

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
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
        ready, started = ready_engines(stats), started_engines(stats)
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
