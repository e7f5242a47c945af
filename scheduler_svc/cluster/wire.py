"""The cluster process's messages with its front ends, on its query socket (a ROUTER): each
front end reports its counters every STATE_INTERVAL_S and gets the cluster's state back (which
replicas serve, where their engine cores listen, which engine cores went down), and asks for
the cluster's statistics (ServerInfo).

MessagePack-encoded msgspec structs on the base and limits of `services.wire` (decoded with
type and size validation and the cluster's frame tag, services.codec); never pickled.

Front end -> cluster (DEALER/ROUTER): `FrontendReport` (answered with `ClusterState`) and
`StatsQuery` (answered with `ClusterStatsReply`). Abort by the client's request id, which any
front end may hold (the kernel spreads a client's connections over them): the asking front end
sends `AbortQuery`, the hub passes it to every other front end, each answers `AbortAnswer`,
and the hub answers the asker with whether any found the request.
Cluster -> front end (stdin, once): `FrontendLaunch`.
"""

from typing import Annotated

from msgspec import Meta

from scheduler_svc.config import ServerConfig
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.wire import Address, EngineStats, FrontendIndex
from services.kv_store_wire import StoreStats
from services.kv_wire import Epoch
from services.wire import MAX_ID_LEN, Count, _Wire

STATE_INTERVAL_S = 0.1    # how often a front end reports (and learns the state)
MAX_REPLICAS = 1 << 12
MAX_WORKERS = 1 << 14

Name = Annotated[str, Meta(max_length=MAX_ID_LEN)]


class ReplicaEntry(_Wire):
    """A replica whose engine core serves (it takes requests at `address`)."""

    replica_id: Count
    engine_epoch: Epoch                 # its engine core instance
    address: Address                    # the engine core's command socket
    num_kv_blocks: Count


class ClusterState(_Wire):
    """What every front end routes by."""

    seq: Count                          # +1 per change
    ready: list[ReplicaEntry]           # replicas that take requests, by replica id
    kv_reachable: bool                  # kvcache_svc answered the last probe
    draining: bool                      # the scheduler is stopping: no new requests
    max_kv_tokens: Count | None         # the longest request the smallest pool holds
    served_dtype: Name                  # ModelInfo's dtype (replicas' dtypes)
    gone: Annotated[list[tuple[Count, Epoch]], Meta(max_length=MAX_REPLICAS)] = []
    # (replica id, engine epoch) of engine cores that went down recently: their requests move


class FrontendReport(_Wire):
    """A front end's counters, every STATE_INTERVAL_S (and when it starts)."""

    frontend: FrontendIndex
    epoch: Epoch                        # the front end's start time (ns)
    num_live: Count                     # requests with an open client stream
    num_parked: Count                   # of those, waiting for a ready replica
    num_requests_total: Count
    num_migrations: Count               # requests it moved off a lost replica


class StatsQuery(_Wire):
    """ServerInfo's question, with the asking front end's counters now."""

    report: FrontendReport


class WorkerInfo(_Wire):
    worker_id: Name
    epoch: Epoch
    pp_rank: Count
    tp_rank: Count
    device: Name
    num_kv_blocks: Count                # what it measured it fits (0: not reported yet)
    state: Name
    cpu_level: Name
    num_kv_chunks_stored: Count = 0     # its KV saver's, from its heartbeats
    num_kv_saves_skipped: Count = 0


class ReplicaInfo(_Wire):
    replica_id: Count
    state: Name
    dtype: Name
    workers: Annotated[list[WorkerInfo], Meta(max_length=MAX_WORKERS)]
    engine: EngineStats | None          # None until its engine core reported


class ClusterStatsReply(_Wire):
    replicas: Annotated[list[ReplicaInfo], Meta(max_length=MAX_REPLICAS)]
    num_migrations: Count
    num_parked: Count
    num_requests_total: Count
    kv_reachable: bool
    kv_store: StoreStats | None = None
    # The state as of the same moment: the asking front end routes by it from now on (a
    # client that saw a replica ready in ServerInfo finds it ready for its next request).
    state: ClusterState | None = None
    # Each front end's latest report, by index (the asker's as of its question).
    frontends: Annotated[list[FrontendReport], Meta(max_length=256)] = []


class AbortQuery(_Wire):
    """Cancel every live request with this client id (the Abort RPC), on every front end."""

    frontend: FrontendIndex             # who asked
    query_id: Count                     # the asker's, echoed in the answers
    request_id: Name
    # With API keys: the asking client's key digest (services.api_keys); only its own
    # requests are cancelled. "": no keys, any request of that id.
    owner: Annotated[str, Meta(max_length=128)] = ""


class AbortAnswer(_Wire):
    """Whether a front end (or, from the hub to the asker, any) held such a request."""

    frontend: FrontendIndex             # who asked
    query_id: Count
    found: bool


def ready_engines(stats: ClusterStatsReply) -> list[EngineStats]:
    return [r.engine for r in stats.replicas if r.state == "ready" and r.engine is not None]


def started_engines(stats: ClusterStatsReply) -> list[EngineStats]:
    return [r.engine for r in stats.replicas if r.engine is not None]


def prefix_cache_hit_rate(stats: ClusterStatsReply) -> float:
    started = started_engines(stats)
    queries = sum(e.num_prompt_tokens_admitted for e in started)
    hits = sum(e.num_cached_tokens_admitted for e in started)
    return hits / queries if queries else 0.0


FromFrontend = FrontendReport | StatsQuery | AbortQuery | AbortAnswer
ToFrontend = ClusterState | ClusterStatsReply | AbortQuery | AbortAnswer


class FrontendLaunch(_Wire):
    """What the cluster hands a new front-end process on its stdin."""

    index: FrontendIndex
    parent_pid: Count
    server: ServerConfig
    scheduler: SchedulerConfig
    served_name: Name
    query_address: Address              # the cluster's query socket (ROUTER)
    # The interface of its own listener for engine outputs: the cluster's internal one.
    internal_host: Annotated[str, Meta(min_length=1, max_length=255)] = "127.0.0.1"
    drain_timeout_s: Annotated[float, Meta(ge=0.0)] = 30.0   # SIGTERM: live requests finish
    log_level: Annotated[str, Meta(max_length=16)] = "info"
