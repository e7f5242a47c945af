"""Snapshots of the cluster's state, the one source for ServerInfo and /metrics.

Each engine publishes an `EngineStats` from its own thread after every pass of its loop (an
immutable object, swapped in whole), so readers on other threads never touch a `Scheduler`.
`cluster_stats` adds membership's replicas and workers and the router's counts.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.kv_store_wire import StoreStats

if TYPE_CHECKING:
    from scheduler_svc.membership import Membership
    from scheduler_svc.router import Router


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_kv_blocks: int                   # the replica's pool, null block included
    num_usable_blocks: int               # num_kv_blocks - 1: the null block holds nothing
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int                 # since the engine started
    num_steps: int
    num_kv_recoveries: int               # pools re-created in kvcache_svc
    kv_ok: bool                          # kvcache_svc holds the pool
    forward_gap_ms_total: float          # worker idle time between steps (StepTimings.gap_ms)
    num_forward_gaps: int
    num_prompt_tokens_admitted: int      # prefix-cache queries, in tokens
    num_cached_tokens_admitted: int      # prefix-cache hits, in tokens
    num_store_hit_tokens: int = 0        # admitted as loads from the KV store (store_loads.py)
    num_store_miss_tokens: int = 0       # admitted prompt tokens in neither cache nor store
    num_store_loaded_tokens: int = 0     # of the hits, loaded by every rank
    num_store_load_fallbacks: int = 0    # loads that came back short (the rest recomputed)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    worker_id: str
    epoch: int
    pp_rank: int
    tp_rank: int
    device: str
    num_kv_blocks: int                   # what it measured it fits (0: not reported yet)
    state: str
    cpu_level: str
    num_kv_chunks_stored: int = 0        # its KV saver's, from its heartbeats
    num_kv_saves_skipped: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    replica_id: int
    state: str
    dtype: str
    workers: tuple[WorkerStats, ...]
    engine: EngineStats | None           # None until the replica starts


@dataclass(frozen=True, slots=True)
class ClusterStats:
    replicas: tuple[ReplicaStats, ...]
    num_migrations: int
    num_parked: int
    kv_reachable: bool
    kv_store: StoreStats | None = None   # as of membership's last kvcache_svc probe

    @property
    def ready(self) -> list[EngineStats]:
        return [r.engine for r in self.replicas if r.state == "ready" and r.engine is not None]

    @property
    def started(self) -> list[EngineStats]:
        return [r.engine for r in self.replicas if r.engine is not None]

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = sum(e.num_prompt_tokens_admitted for e in self.started)
        hits = sum(e.num_cached_tokens_admitted for e in self.started)
        return hits / queries if queries else 0.0


def cluster_stats(membership: "Membership", router: "Router") -> ClusterStats:
    replicas = tuple(
        ReplicaStats(r.replica_id, str(r.state), r.dtype,
                     tuple(WorkerStats(w.worker_id, w.epoch, w.pp_rank, w.tp_rank, w.device,
                                       w.num_kv_blocks or 0, str(w.state), w.cpu_level,
                                       w.num_kv_chunks_stored, w.num_kv_saves_skipped)
                           for w in r.workers),
                     r.engine.stats() if r.engine is not None else None)
        for r in membership.replica_list())
    return ClusterStats(replicas, router.num_migrations, router.live.num_parked,
                        membership.kv_reachable, membership.kv_store_stats)
