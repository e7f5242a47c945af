"""The cluster's statistics, the one source for ServerInfo and /metrics: membership's replicas
and workers, each engine core's latest reported counters, and the front ends' latest reports.

`cluster_stats_reply` builds the snapshot (a wire struct: a front end asks for it over the
hub's query socket for ServerInfo, and the cluster's metrics read the same); the sums over it
are beside the struct (cluster.wire).
"""

from scheduler_svc.cluster.membership import Membership
from scheduler_svc.cluster.wire import (
    ClusterStatsReply,
    FrontendReport,
    ReplicaInfo,
    WorkerInfo,
)


def cluster_stats_reply(membership: Membership,
                        frontends: list[FrontendReport]) -> ClusterStatsReply:
    replicas = [
        ReplicaInfo(r.replica_id, str(r.state), r.dtype,
                    [WorkerInfo(w.worker_id, w.epoch, w.pp_rank, w.tp_rank, w.device,
                                w.num_kv_blocks or 0, str(w.state), w.cpu_level,
                                w.num_kv_chunks_stored, w.num_kv_saves_skipped)
                     for w in r.workers],
                    r.engine.stats if r.engine is not None else None)
        for r in membership.replica_list()]
    return ClusterStatsReply(
        replicas=replicas, num_migrations=sum(f.num_migrations for f in frontends),
        num_parked=sum(f.num_parked for f in frontends),
        num_requests_total=sum(f.num_requests_total for f in frontends),
        kv_reachable=membership.kv.reachable, kv_store=membership.kv.store_stats,
        frontends=sorted(frontends, key=lambda f: f.frontend))
