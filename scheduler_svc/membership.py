"""Cluster membership: who is registered, how ranks form replicas, and what happens when a
worker or kvcache_svc is lost. Where requests run is router.py's job; membership tells it
about replicas through `ReplicaListener` and never reads a request.

A worker registers (id, epoch, device, memory, step address) and is placed in the replica
being formed as the next free (pp_rank, tp_rank). After loading its shard it reports how many
KV blocks fit its own layers; when every rank has reported, the replica uses the minimum (or
the `--num-kv-blocks` override), and its `ReplicaEngine` brings the pool and caches up.
(The records and the layer/rendezvous arithmetic live in placement.py.) When a replica is
ready, the listener hears `replica_ready`.

A monitor thread checks heartbeats: a worker silent for `--heartbeat-timeout` takes its
replica down; its engine stops and the listener gets its live requests (`replica_down`) to
place again (migration). A worker registering again with a newer epoch is a new member (its
old replica goes down); an older or equal epoch is refused. The monitor also probes
kvcache_svc, which with a ready replica decides readiness. One GPU, one worker: see
placement.gpu_holder.
"""

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from scheduler_svc.config import EngineConfig, SchedulerConfig, ServerConfig
from scheduler_svc.engine import OnOutputs, ReplicaEngine
from scheduler_svc.engine_transport import ZmqTransport
from scheduler_svc.placement import (
    GONE_STATES,
    Placement,
    RegistrationError,
    Replica,
    ReplicaState,
    WorkerRecord,
    WorkerState,
    gpu_holder,
    gpu_taken_message,
    kv_blocks_problem,
    rendezvous_address,
    replica_dtype,
    split_layers,
)
from scheduler_svc.request import Request
from services.channels import Receiver, RequestClient, tcp_address
from services.codec import Codec
from services.kv_groups import max_tokens_per_request
from services.kv_store_wire import KvSlice, StoreStats
from services.kv_wire import (
    FromKvCache,
    PrefixQuery,
    PrefixReply,
)
from services.model_config import ModelConfig
from services.wire import (
    FromWorker,
)

log = logging.getLogger(__name__)

MAX_DOWN_REPLICAS = 16     # down replicas kept for ServerInfo (their sockets closed)
MONITOR_INTERVAL_S = 0.5
KV_PROBE_TIMEOUT_MS = 1000


class ReplicaListener(Protocol):
    """Who places requests (the router): told when replicas come and go."""

    def replica_ready(self) -> None: ...

    def replica_down(self, engine: ReplicaEngine, orphans: list[Request]) -> None: ...


class Membership:
    def __init__(self, config: ServerConfig, sched_config: SchedulerConfig, model: ModelConfig,
                 ctx: zmq.Context, on_outputs: OnOutputs,
                 on_change: Callable[[], None] = lambda: None) -> None:
        """`on_outputs`: where every engine delivers its requests' outputs."""
        self.config = config
        self.sched_config = sched_config
        self.model = model
        self.ctx = ctx
        self._on_outputs = on_outputs
        self._listeners: list[ReplicaListener] = []
        self.on_change = on_change      # readiness may have changed (called from any thread)
        self._lock = threading.RLock()
        self.replicas: dict[int, Replica] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self._next_replica_id = 0
        self._layer_ranges = split_layers(model.num_layers, config.pp_size)
        self.epoch = time.time_ns()     # this instance; kvcache_svc drops older ones' pools
        self.kv_reachable = False       # set by the monitor's probe
        self.kv_store_stats: StoreStats | None = None   # the store's, from the same probe
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="cluster-monitor",
                                         daemon=True)

    def listen(self, listener: ReplicaListener) -> None:
        self._listeners.append(listener)

    def start(self) -> None:
        self._monitor.start()

    # ------------------------------------------------------------------ registration

    def register(self, worker_id: str, epoch: int, device: str, memory_bytes: int,
                 step_address: str, model: str, preferred_dtype: str = "",
                 cpu_level: str = "", device_uuid: str = "") -> Placement:
        """Places a worker as the next free rank of the replica being formed. `preferred_dtype`:
        what the worker computes best in; with `--dtype auto` the first rank's choice becomes
        the replica's (later ranks follow it: every rank of a replica must agree).
        `device_uuid`: its GPU ("" on the CPU); a GPU another live worker holds is refused."""
        # `model` is the name of the model the worker loaded (file stem or directory name),
        # checked against the one this scheduler loaded; --served-model-name is only the
        # public alias and never reaches this comparison.
        if model and model != self.model.name:
            raise RegistrationError(f"worker serves {model!r}; this cluster serves "
                                    f"{self.model.name!r}")
        with self._lock:
            old = self.workers.get(worker_id)
            if old is not None and epoch <= old.epoch:
                raise RegistrationError(
                    f"worker {worker_id} epoch {epoch} is not newer than {old.epoch}")
            # Checked before anything changes: a refused worker must not take down the old
            # incarnation's replica.
            if holder := gpu_holder(self.workers.values(), device_uuid, worker_id):
                message = gpu_taken_message(device_uuid, holder, worker_id)
                log.warning("registration refused: %s", message)
                raise RegistrationError(message)
            if old is not None:
                self._replica_lost_locked(old.replica_id, f"worker {worker_id} registered "
                                          f"again (epoch {old.epoch} -> {epoch})")
            replica = self._forming_replica_locked()
            rank = replica.ranks.index(None)
            pp_rank, tp_rank = divmod(rank, self.config.tp_size)
            record = WorkerRecord(worker_id, epoch, device, memory_bytes, step_address,
                                  replica.replica_id, pp_rank, tp_rank, cpu_level=cpu_level,
                                  device_uuid=device_uuid)
            if not replica.dtype:
                replica.dtype = replica_dtype(self.config.dtype, preferred_dtype)
            replica.ranks[rank] = record
            self.workers[worker_id] = record
            if rank == 0 and len(replica.ranks) > 1:
                replica.dist_init_method = rendezvous_address(step_address)
            first, end = self._layer_ranges[pp_rank]
            log.info("worker %s (epoch %d, %s %s) -> replica %d pp_rank %d tp_rank %d layers "
                     "[%d, %d), %s", worker_id, epoch, device, cpu_level, replica.replica_id,
                     pp_rank, tp_rank, first, end, replica.dtype)
            return Placement(replica.replica_id, pp_rank, tp_rank, self.config.pp_size,
                             self.config.tp_size, first, end, replica.outputs.address,
                             replica.dist_init_method, replica.dtype)

    def served_dtype(self) -> str:
        """The dtype the replicas compute in (see ModelInfoResponse.dtype)."""
        if self.config.dtype != "auto":
            return self.config.dtype
        with self._lock:
            live = [r for r in self.replicas.values() if r.state not in GONE_STATES]
        return ",".join(sorted({r.dtype for r in live if r.dtype})) or "auto"

    def _forming_replica_locked(self) -> Replica:
        for replica in self.replicas.values():
            if replica.state == ReplicaState.FORMING and not replica.is_full():
                return replica
        replica_id = self._next_replica_id
        self._next_replica_id += 1
        outputs: Receiver[FromWorker] = Receiver(
            self.ctx, Codec(FromWorker), tcp_address(self.config.advertise_host, 0))
        replica = Replica(replica_id, self.config.pp_size * self.config.tp_size, outputs)
        self.replicas[replica_id] = replica
        return replica

    def report_capacity(self, worker_id: str, epoch: int, num_kv_blocks: int,
                        kv_slice: KvSlice | None = None) -> None:
        """`kv_slice`: the worker's part of the KV when it uses kvcache_svc's store."""
        with self._lock:
            record = self._known_locked(worker_id, epoch)
            record.num_kv_blocks = num_kv_blocks
            record.kv_slice = kv_slice
            record.state = WorkerState.READY
            log.info("worker %s fits %d KV blocks for its layers", worker_id, num_kv_blocks)
            replica = self.replicas[record.replica_id]
            if replica.state != ReplicaState.FORMING or not replica.is_full():
                return
            if any(w.num_kv_blocks is None for w in replica.workers):
                return
            self._start_replica_locked(replica)

    def _start_replica_locked(self, replica: Replica) -> None:
        problem = kv_blocks_problem(replica.workers, self.config.num_kv_blocks)
        if problem is not None:
            # No engine, no InitCache. Its workers stay registered and idle: one restarted
            # with more memory registers with a newer epoch, which takes this replica down
            # and has the others register again into a new one.
            log.error("replica %d not started: %s", replica.replica_id, problem)
            replica.state = ReplicaState.REFUSED
            return
        measured = min(w.num_kv_blocks or 0 for w in replica.workers)
        num_blocks = self.config.num_kv_blocks or measured
        log.info("replica %d: ranks measured %s KV blocks; using %d%s", replica.replica_id,
                 [w.num_kv_blocks for w in replica.workers], num_blocks,
                 " (--num-kv-blocks)" if self.config.num_kv_blocks else " (minimum)")
        engine_config = EngineConfig(
            replica_id=replica.replica_id, scheduler=self.sched_config, num_kv_blocks=num_blocks,
            kv_timeout_s=self.config.kv_timeout_s,
            step_timeout_s=self.config.step_timeout_s,
            ship_sampled_tokens=self.config.pp_size > 1,
            max_batches_in_flight=self.config.max_batches_in_flight or self.config.pp_size,
            async_scheduling=self.config.async_scheduling, scheduler_epoch=self.epoch,
            store_slices=store_slices(replica.workers))
        # Every rank gets every StepInput, ordered by rank.
        addresses = [w.step_address for w in replica.ranks if w is not None]
        outputs, kvcache_address = replica.outputs, self.config.kvcache_address

        def connect() -> ZmqTransport:
            return ZmqTransport(self.ctx, kvcache_address, addresses, outputs,
                                tp_size=self.config.tp_size)

        replica.engine = ReplicaEngine(engine_config, connect, self._on_outputs,
                                       self._on_engine_down, on_kv_change=self.on_change)
        replica.state = ReplicaState.STARTING
        replica.engine.start()
        threading.Thread(target=self._await_ready, args=(replica,), daemon=True).start()

    def _await_ready(self, replica: Replica) -> None:
        engine = replica.engine
        assert engine is not None
        while not engine.ready.wait(0.5):
            if replica.state != ReplicaState.STARTING:
                return
        with self._lock:
            if replica.state == ReplicaState.STARTING:
                replica.state = ReplicaState.READY
        self.on_change()
        for listener in self._listeners:
            listener.replica_ready()

    def heartbeat(self, worker_id: str, epoch: int, num_kv_chunks_stored: int = 0,
                  num_kv_saves_skipped: int = 0) -> bool:
        with self._lock:
            record = self.workers.get(worker_id)
            if record is None or record.epoch != epoch or record.state == WorkerState.DOWN:
                return False
            record.last_heartbeat = time.monotonic()
            record.num_kv_chunks_stored = num_kv_chunks_stored
            record.num_kv_saves_skipped = num_kv_saves_skipped
            return True

    def _known_locked(self, worker_id: str, epoch: int) -> WorkerRecord:
        record = self.workers.get(worker_id)
        if record is None or record.epoch != epoch:
            raise RegistrationError(f"unknown worker {worker_id} epoch {epoch}; register first")
        return record

    # ------------------------------------------------------------------ replica life

    def _on_engine_down(self, replica_id: int, reason: str, orphans: list[Request]) -> None:
        """Called from the engine's thread once it stopped: its live requests move on."""
        with self._lock:
            engine = self.replicas[replica_id].engine
            self._mark_down_locked(replica_id, reason)
            self._retire_locked(replica_id)       # its engine no longer reads the socket
        self.on_change()
        assert engine is not None
        for listener in self._listeners:
            listener.replica_down(engine, orphans)

    def _replica_lost_locked(self, replica_id: int, reason: str) -> None:
        """Take a replica down; its engine (if any) stops and hands its requests back."""
        replica = self.replicas.get(replica_id)
        if replica is None or replica.state == ReplicaState.DOWN:
            return
        self._mark_down_locked(replica_id, reason)
        if replica.engine is not None:
            replica.engine.fail_over(reason)

    def _mark_down_locked(self, replica_id: int, reason: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None or replica.state == ReplicaState.DOWN:
            return
        log.warning("replica %d down: %s", replica_id, reason)
        replica.state = ReplicaState.DOWN
        # The surviving ranks learn it from their next heartbeat and register again.
        for record in replica.workers:
            record.state = WorkerState.DOWN
        if replica.engine is None:
            self._retire_locked(replica_id)

    def _retire_locked(self, replica_id: int) -> None:
        """A down replica's output socket closes; only the last MAX_DOWN_REPLICAS down ones
        (and their workers) stay listed: churn must not grow sockets and memory unbounded."""
        self.replicas[replica_id].outputs.close()
        down = [r for r in self.replicas.values() if r.state == ReplicaState.DOWN]
        for old in down[:max(0, len(down) - MAX_DOWN_REPLICAS)]:   # closed when they retired
            del self.replicas[old.replica_id]
            for record in old.workers:
                if self.workers.get(record.worker_id) is record:
                    del self.workers[record.worker_id]

    def replica_list(self) -> list[Replica]:
        with self._lock:
            return list(self.replicas.values())

    def ready_replicas(self) -> list[Replica]:
        return [r for r in self.replicas.values()
                if r.state == ReplicaState.READY and r.engine is not None and r.engine.kv_ok]

    def is_ready(self) -> bool:
        """Readiness: a replica can serve and kvcache_svc answers."""
        return self.kv_reachable and bool(self.ready_replicas())

    # ------------------------------------------------------------------ monitor

    def _monitor_loop(self) -> None:
        probe: RequestClient[FromKvCache] = RequestClient(self.ctx, Codec(FromKvCache),
                                                          self.config.kvcache_address)
        try:
            while not self._stop.wait(MONITOR_INTERVAL_S):
                try:
                    self._check_heartbeats()
                    self._probe_kvcache(probe)
                except Exception:  # never let the monitor die
                    log.exception("cluster monitor pass failed")
        finally:
            probe.close()

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        timeout = self.config.heartbeat_timeout_s
        lost = False
        with self._lock:
            for record in list(self.workers.values()):
                if record.state != WorkerState.DOWN and now - record.last_heartbeat > timeout:
                    log.warning("worker %s (replica %d) missed heartbeats for %.1fs",
                                record.worker_id, record.replica_id, now - record.last_heartbeat)
                    self._replica_lost_locked(
                        record.replica_id, f"worker {record.worker_id} lost (no heartbeat for "
                        f"{now - record.last_heartbeat:.1f}s)")
                    lost = True
        if lost:
            self.on_change()

    def _probe_kvcache(self, probe: RequestClient[FromKvCache]) -> None:
        reply = probe.call(PrefixQuery(block_hashes=[]), timeout_ms=KV_PROBE_TIMEOUT_MS)
        reachable = isinstance(reply, PrefixReply)
        if isinstance(reply, PrefixReply):
            self.kv_store_stats = reply.store
        if reachable != self.kv_reachable:
            log.warning("kvcache_svc %s", "reachable" if reachable else "unreachable")
            self.kv_reachable = reachable
            self.on_change()

    def max_kv_tokens(self) -> int | None:
        """Tokens one request can hold on the smallest replica that served, or that will: with
        --num-kv-blocks every replica that starts has exactly that many blocks, so requests
        are checked before the first one is up (None: not known yet)."""
        blocks = [r.engine.config.num_kv_blocks for r in list(self.replicas.values())
                  if r.engine is not None]
        if self.config.num_kv_blocks is not None:
            blocks.append(self.config.num_kv_blocks)
        if not blocks:
            return None
        sc = self.sched_config
        max_step = sc.token_budget
        if sc.chunked_prefill and sc.long_prefill_token_threshold > 0:
            max_step = min(max_step, sc.long_prefill_token_threshold)
        # Every KV group counted; a sliding group holds at most a window of blocks (the
        # replica's scheduler checks again, with the KV store's chunks kept).
        return max_tokens_per_request(sc.kv_group_windows, min(blocks) - 1, sc.block_size,
                                      max_step)

    def shutdown(self) -> None:
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(timeout=5)
        for replica in list(self.replicas.values()):
            if replica.engine is not None:
                replica.engine.stop()
            replica.outputs.close()


def store_slices(workers: list[WorkerRecord]) -> tuple[KvSlice, ...]:
    """The replica's slices of its KV in the store, in rank order; empty (no loads) unless
    every rank uses the store."""
    slices = [w.kv_slice for w in workers]
    if any(kv_slice is None for kv_slice in slices):
        return ()
    return tuple(kv_slice for kv_slice in slices if kv_slice is not None)
