"""The scheduler's /metrics (scheduler_svc.cluster.metrics): vLLM's per-engine families,
labelled `model_name` and `engine` (the replica id), read from the cluster's statistics; the
front-end processes' request metrics summed from prometheus_client's multiprocess files; the
cluster process's own process collectors."""

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.cluster.metrics import ClusterMetrics
from scheduler_svc.cluster.wire import ClusterStatsReply, ReplicaInfo
from scheduler_svc.engine.wire import EngineStats
from tests.scheduler_svc.cluster.fakes import engine_stats

MODEL = "tiny"

# One front-end process: a request of 4 prompt tokens, 2 generated, ended on replica 1.
FRONT_END = """
from scheduler_svc.engine.wire import Timing
from scheduler_svc.frontend.metrics import RequestMetrics, RequestTimer
timer = RequestTimer(RequestMetrics("tiny", max_model_len=64))
timer.tokens(1, 1)
timer.tokens(1, 1)
timer.finished("stop", 4, 2, 8, Timing(queued_s=0.5, prefill_s=1.0, decode_s=0.25,
                                       inference_s=1.25))
"""


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def key(name: str, engine: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset({"model_name": MODEL, "engine": engine, **labels}.items())


def replica(replica_id: int, state: str, engine: EngineStats | None) -> ReplicaInfo:
    return ReplicaInfo(replica_id=replica_id, state=state, dtype="float32", workers=[],
                       engine=engine)


def stats(num_parked: int = 0) -> ClusterStatsReply:
    busy = engine_stats(num_kv_blocks=65)
    busy = EngineStats(**{**{f: getattr(busy, f) for f in busy.__struct_fields__},
                          "num_free_blocks": 48, "num_running": 3, "num_waiting": 2,
                          "num_preemptions": 4, "num_prompt_tokens_admitted": 90,
                          "num_cached_tokens_admitted": 30})
    return ClusterStatsReply(
        replicas=[replica(0, "ready", engine_stats()), replica(1, "ready", busy),
                  replica(2, "starting", None)],
        num_migrations=0, num_parked=num_parked, num_requests_total=0, kv_reachable=True)


def test_engine_families_per_replica() -> None:
    got = samples(ClusterMetrics(MODEL, lambda: stats(num_parked=5), None).render().decode())
    assert got[key("vllm:num_requests_running", "1")] == 3
    assert got[key("vllm:num_requests_running", "0")] == 0
    assert got[key("vllm:num_requests_waiting", "1")] == 2
    assert got[key("vllm:num_requests_waiting", "none")] == 5     # parked in the front ends
    assert got[key("vllm:kv_cache_usage_perc", "1")] == 0.25       # 16 of 64 usable blocks
    assert got[key("vllm:gpu_cache_usage_perc", "1")] == 0.25
    assert got[key("vllm:kv_cache_usage_perc", "0")] == 0.0
    assert got[key("vllm:num_preemptions_total", "1")] == 4
    assert got[key("vllm:prefix_cache_queries_total", "1")] == 90
    assert got[key("vllm:prefix_cache_hits_total", "1")] == 30
    assert not any(dict(labels).get("engine") == "2" for _, labels in got)   # not started
    assert any(name == "process_cpu_seconds_total" for name, _ in got)
    assert any(name == "python_info" for name, _ in got)


def test_front_ends_request_metrics_are_summed_per_engine(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):      # two front-end processes
        subprocess.run([sys.executable, "-c", FRONT_END], env=env, check=True, timeout=60)
    got = samples(ClusterMetrics(MODEL, stats, str(tmp_path)).render().decode())
    assert got[key("vllm:request_success_total", "1", finished_reason="stop")] == 2
    assert got[key("vllm:time_to_first_token_seconds_count", "1")] == 2
    assert got[key("vllm:inter_token_latency_seconds_count", "1")] == 2
    assert got[key("vllm:request_queue_time_seconds_sum", "1")] == 1.0
    assert got[key("vllm:request_prefill_time_seconds_sum", "1")] == 2.0
    assert got[key("vllm:request_decode_time_seconds_sum", "1")] == 0.5
    assert got[key("vllm:request_inference_time_seconds_sum", "1")] == 2.5
    assert got[key("vllm:request_prompt_tokens_sum", "1")] == 8
    assert got[key("vllm:request_generation_tokens_bucket", "1", le="2.0")] == 2
    assert got[key("vllm:request_max_num_generation_tokens_count", "1")] == 2
    assert got[key("vllm:generation_tokens_total", "1")] == 4
