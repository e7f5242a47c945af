"""Every replica's block pool in kvcache_svc, behind one lock: plan messages in, replies out.

`KvCachePools` holds each replica's `ReplicaBlockManager` and turns each `ToKvCache` message
(plan, configure, drop, prefix query) into its reply; it needs no network. It also owns the
instance epoch, stamped on every reply so the scheduler notices a restart, and turns each
operation's prefix-index changes into one `KvEventBatch` for a publish callback. Called by the
plan loop (plan_loop.py) and the admin servicer (admin.py).
"""

import logging
import threading
import time
from collections.abc import Callable

from kvcache_svc.block_manager import PoolStats, ReplicaBlockManager
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.view import StoreView
from services.kv_wire import (
    MAX_REPLICAS,
    AllBlocksCleared,
    ConfigurePool,
    DropPool,
    FromKvCache,
    KvAck,
    KvEvent,
    KvEventBatch,
    PlanReply,
    PlanRequest,
    PrefixQuery,
    PrefixReply,
    ReplicaPrefix,
    ToKvCache,
    future_epoch,
)

log = logging.getLogger(__name__)

MAX_ERROR_LEN = 4096  # wire limit of PlanReply.error and KvAck.error


class KvCachePools:
    """Every replica's block manager, and the dispatch of plan-channel messages to them.

    One lock covers all pools: the plan loop and admin RPCs run on different threads. Event
    batches are handed to `publish` under that lock, so they leave in operation order.
    """

    def __init__(self, epoch: int | None = None,
                 publish: Callable[[KvEventBatch], None] | None = None) -> None:
        """`epoch` defaults to now (ns since the Unix epoch); `publish`, when given, receives
        one batch per operation that changed a prefix index, and must not raise."""
        self.epoch = time.time_ns() if epoch is None else epoch
        if not 0 <= self.epoch < 1 << 63:
            raise ValueError(f"epoch must be in [0, 2**63), got {self.epoch}")
        self._publish = publish
        self._seq = 0                       # of the next batch published
        self._lock = threading.Lock()
        self._managers: dict[int, ReplicaBlockManager] = {}
        self.scheduler_epoch = 0   # the scheduler instance that owns the pools
        self.num_plans = 0
        # The KV store (set by KvCacheServer once built): admissions of a pool configured with
        # its ranks' slices load what it holds past their prefix hit.
        self.store: KvStore | None = None

    def handle(self, message: ToKvCache) -> FromKvCache:
        """The reply to one message. Never raises: a failure becomes an error reply (a
        PlanReply for a plan, a KvAck for anything else)."""
        try:
            with self._lock:
                if isinstance(message, PlanRequest):
                    return self._plan(message)
                if isinstance(message, ConfigurePool):
                    return self._configure(message)
                if isinstance(message, DropPool):
                    return self._drop(message)
                return self._query(message)
        except Exception as exc:
            log.exception("failed to handle %s", type(message).__name__)
            error = f"internal error: {type(exc).__name__}: {exc}"[:MAX_ERROR_LEN]
            if isinstance(message, PlanRequest):
                return PlanReply(message.plan_id, [], [], 0, error, self.epoch)
            return KvAck(error, self.epoch)

    def _plan(self, plan: PlanRequest) -> PlanReply:
        self.num_plans += 1
        manager = self._managers.get(plan.replica_id)
        if manager is None:
            return PlanReply(plan.plan_id, [], [], 0,
                             f"unknown replica {plan.replica_id}: its pool is not configured "
                             f"(or was dropped)", self.epoch)
        try:
            reply = manager.apply(plan)
        finally:
            # A plan that failed half way may still have changed the index: report it all.
            self._publish_events(plan.replica_id, manager.drain_events())
        if reply.error is not None:
            log.warning("refused plan %d of replica %d: %s",
                        plan.plan_id, plan.replica_id, reply.error)
        return reply

    def _configure(self, message: ConfigurePool) -> KvAck:
        if (problem := future_epoch(message.scheduler_epoch)) is not None:
            return KvAck(f"scheduler {problem}", self.epoch)
        if message.scheduler_epoch < self.scheduler_epoch:
            return KvAck(f"scheduler epoch {message.scheduler_epoch} is older than "
                         f"{self.scheduler_epoch}: a newer scheduler owns the pools",
                         self.epoch)
        if message.scheduler_epoch > self.scheduler_epoch:
            if self._managers:
                log.warning("a new scheduler (epoch %d) took over: dropping the %d pools of "
                            "the previous one", message.scheduler_epoch, len(self._managers))
            for replica_id in sorted(self._managers):
                del self._managers[replica_id]
                self._publish_events(replica_id, [AllBlocksCleared()])
            self.scheduler_epoch = message.scheduler_epoch
        if message.replica_id not in self._managers and len(self._managers) >= MAX_REPLICAS:
            return KvAck(f"cannot configure replica {message.replica_id}: already "
                         f"{MAX_REPLICAS} pools", self.epoch)
        save_chunk_tokens = self._save_chunk_tokens(message)
        try:
            manager = ReplicaBlockManager(message.num_blocks, message.block_size,
                                          message.enable_prefix_caching, epoch=self.epoch,
                                          record_events=self._publish is not None,
                                          store=self._store_view(message),
                                          group_windows=message.group_windows,
                                          save_chunk_tokens=save_chunk_tokens)
        except ValueError as exc:
            return KvAck(str(exc)[:MAX_ERROR_LEN], self.epoch)
        # A restarted scheduler re-uses replica ids from 0: the old pool and its index go.
        replaced = self._managers.get(message.replica_id) is not None
        self._managers[message.replica_id] = manager
        if replaced:
            self._publish_events(message.replica_id, [AllBlocksCleared()])
        log.info("%s pool of replica %d: %d blocks of %d tokens, KV group windows %s, prefix "
                 "caching %s, loads from the KV store %s%s",
                 "re-created" if replaced else "created", message.replica_id,
                 message.num_blocks, message.block_size, list(message.group_windows),
                 "on" if message.enable_prefix_caching else "off",
                 "on" if manager.store is not None else "off",
                 f"; sliding groups keep the store chunk in progress ({save_chunk_tokens} "
                 f"tokens)" if save_chunk_tokens else "")
        return KvAck(None, self.epoch, save_chunk_tokens)

    def _save_chunk_tokens(self, message: ConfigurePool) -> int:
        """The chunk size the replica's workers save KV in, when they save (this process runs
        the store, in whole blocks) and a sliding group must keep a chunk's blocks until it
        is complete; else 0. Workers that are not told of a store save nothing, so holding
        for them costs at most one chunk per request and is never wrong."""
        if self.store is None or not any(message.group_windows):   # no sliding group
            return 0
        if self.store.chunk_tokens % message.block_size:
            return 0
        return self.store.chunk_tokens

    def _store_view(self, message: ConfigurePool) -> StoreView | None:
        if self.store is None or not message.store_slices:
            return None
        try:
            return StoreView(self.store, message.store_slices, message.block_size)
        except ValueError as exc:
            log.warning("replica %d will not load from the KV store: %s", message.replica_id,
                        exc)
            return None

    def _drop(self, message: DropPool) -> KvAck:
        if self._managers.pop(message.replica_id, None) is not None:
            log.info("dropped pool of replica %d", message.replica_id)
            self._publish_events(message.replica_id, [AllBlocksCleared()])
        return KvAck(None, self.epoch)

    def _query(self, query: PrefixQuery) -> PrefixReply:
        """Read-only: O(len(block_hashes)) dict lookups per pool, at most."""
        return PrefixReply(self.epoch, [
            ReplicaPrefix(replica_id, manager.num_cached_prefix_blocks(query.block_hashes),
                          manager.num_stored_prefix_blocks(query.block_hashes))
            for replica_id, manager in sorted(self._managers.items())],
            None if self.store is None else self.store.stats())

    def _publish_events(self, replica_id: int, events: list[KvEvent]) -> None:
        if not events or self._publish is None:
            return
        batch = KvEventBatch(self.epoch, self._seq, replica_id, events)
        self._seq += 1
        self._publish(batch)

    def stats(self) -> tuple[dict[int, PoolStats], int]:
        """Per replica stats, and the number of plan calls served."""
        with self._lock:
            pools = {replica_id: manager.stats()
                     for replica_id, manager in sorted(self._managers.items())}
            return pools, self.num_plans

    def clear(self, replica_id: int | None) -> int | None:
        """Drops cached unreferenced blocks of one replica (or every one); the count dropped,
        or None when `replica_id` names no pool."""
        with self._lock:
            if replica_id is None:
                return sum(self._clear(each_id, manager)
                           for each_id, manager in sorted(self._managers.items()))
            manager = self._managers.get(replica_id)
            return None if manager is None else self._clear(replica_id, manager)

    def _clear(self, replica_id: int, manager: ReplicaBlockManager) -> int:
        num_cleared = manager.clear()
        events = manager.drain_events()
        # Blocks in use keep their hashes: only an index left empty is "all cleared".
        if num_cleared and manager.pool.num_cached_blocks == 0:
            events = [AllBlocksCleared()]
        self._publish_events(replica_id, events)
        return num_cleared
