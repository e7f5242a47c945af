"""The cluster's watch on kvcache_svc (scheduler_svc.cluster.membership's monitor, every pass):
whether it answers (with a ready replica, that decides readiness), its KV store's figures, and
the pools of engine cores that died holding one, dropped there (their blocks describe KV that
no longer exists; an engine core that goes down drops its own).
"""

import logging
import threading

from services.channels import RequestClient
from services.kv_store_wire import StoreStats
from services.kv_wire import DropPool, FromKvCache, PrefixQuery, PrefixReply

log = logging.getLogger(__name__)

KV_PROBE_TIMEOUT_MS = 1000


class KvWatch:
    def __init__(self) -> None:
        self.reachable = False                       # it answered the last probe
        self.store_stats: StoreStats | None = None   # the store's, from the same probe
        self._lock = threading.Lock()
        self._pools_to_drop: list[int] = []          # replicas whose engine core died

    def drop_pool_of(self, replica_id: int) -> None:
        """The replica's engine core died holding its pool: drop it on the next pass (any
        thread)."""
        with self._lock:
            self._pools_to_drop.append(replica_id)

    def probe(self, client: RequestClient[FromKvCache]) -> bool:
        """One pass: probe, then drop the pools due. Whether reachability changed."""
        reply = client.call(PrefixQuery(block_hashes=[]), timeout_ms=KV_PROBE_TIMEOUT_MS)
        reachable = isinstance(reply, PrefixReply)
        if isinstance(reply, PrefixReply):
            self.store_stats = reply.store
        changed = reachable != self.reachable
        if changed:
            log.warning("kvcache_svc %s", "reachable" if reachable else "unreachable")
            self.reachable = reachable
        with self._lock:
            drop, self._pools_to_drop = self._pools_to_drop, []
        for replica_id in drop:
            client.call(DropPool(replica_id=replica_id), timeout_ms=KV_PROBE_TIMEOUT_MS)
        return changed
