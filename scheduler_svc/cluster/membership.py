"""Cluster membership: who is registered, how ranks form replicas, and what happens when a
worker, an engine core or kvcache_svc is lost. Where requests run is the front ends' job
(scheduler_svc.frontend.router); membership publishes which replicas serve through the
cluster's state (`cluster_state`), which the front ends read.

A worker registers (id, epoch, device, memory, step address) and is placed in the replica
being formed as the next free (pp_rank, tp_rank); it is told where its replica's outputs go.
After loading its shard it reports how many KV blocks fit its own layers; when every rank has
reported, the replica uses the minimum (or the `--num-kv-blocks` override) and its engine core
process starts (`EngineControl.start`), which brings the pool and caches up and reports ready.
(The records and the layer/rendezvous arithmetic live in placement.py.)

A monitor thread checks heartbeats: a worker silent for `--heartbeat-timeout` takes its
replica down: its engine core is told to stop, tells its front ends, and they move its
requests to another replica. An engine core that says it went down, or whose process exits,
takes its replica down the same way (its ranks register again). A worker registering again
with a newer epoch is a new member (its old replica goes down); an older or equal epoch is
refused. The monitor also watches kvcache_svc (kv_watch.py), which with a ready replica
decides readiness, and drops the pool of an engine core that died without dropping it. One
GPU, one worker: see placement.gpu_holder.
"""

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import zmq

from scheduler_svc.cluster.engines import EngineProcess, stop_all
from scheduler_svc.cluster.kv_watch import KvWatch
from scheduler_svc.cluster.placement import (
    GONE_STATES,
    Placement,
    RegistrationError,
    Replica,
    ReplicaState,
    WorkerRecord,
    WorkerState,
    engine_config_for,
    free_address,
    gpu_holder,
    gpu_taken_message,
    kv_blocks_problem,
    replica_dtype,
    request_token_limit,
    split_layers,
)
from scheduler_svc.cluster.wire import ClusterState, ReplicaEntry
from scheduler_svc.config import ServerConfig
from scheduler_svc.engine.config import EngineConfig, SchedulerConfig
from scheduler_svc.engine.wire import EngineReport
from services.channels import RequestClient
from services.codec import Codec
from services.kv_store_wire import KvSlice
from services.kv_wire import (
    FromKvCache,
)
from services.model_config import ModelConfig

log = logging.getLogger(__name__)

MAX_DOWN_REPLICAS = 16     # down replicas kept for ServerInfo
MAX_GONE_ENGINES = 64      # engine cores that went down, kept in the state for front ends
MONITOR_INTERVAL_S = 0.5


class EngineControl(Protocol):
    """Starts and stops engine core processes (the cluster's hub; tests fake it)."""

    def start_engine(self, replica: Replica, config: EngineConfig) -> EngineProcess: ...

    def stop_engine(self, engine: EngineProcess, reason: str) -> None: ...


class Membership:
    def __init__(self, config: ServerConfig, sched_config: SchedulerConfig, model: ModelConfig,
                 ctx: zmq.Context, engines: EngineControl,
                 on_change: Callable[[], None] = lambda: None) -> None:
        """`engines`: how engine cores start and stop. `on_change`: the cluster's state
        changed (called from any thread)."""
        self.config = config
        self.sched_config = sched_config
        self.model = model
        self.ctx = ctx
        self.engines = engines
        self.on_change = on_change
        self._lock = threading.RLock()
        self.replicas: dict[int, Replica] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self._next_replica_id = 0
        self._layer_ranges = split_layers(model.num_layers, config.pp_size)
        self.epoch = time.time_ns()     # this instance; kvcache_svc drops older ones' pools
        self.kv = KvWatch()             # kvcache_svc, as the monitor's probe finds it
        self.draining = False           # SIGTERM: the front ends take no new requests
        self._gone: deque[tuple[int, int]] = deque(maxlen=MAX_GONE_ENGINES)
        self._seq = 0                   # +1 per change of the cluster's state
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="cluster-monitor",
                                         daemon=True)

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
            record = WorkerRecord(worker_id, epoch, device, memory_bytes, step_address,
                                  replica.replica_id, pp_rank=-1, tp_rank=-1,
                                  cpu_level=cpu_level, device_uuid=device_uuid)
            pp_rank, tp_rank = replica.seat(record, self.config.tp_size)
            if not replica.dtype:
                replica.dtype = replica_dtype(self.config.dtype, preferred_dtype)
            self.workers[worker_id] = record
            first, end = self._layer_ranges[pp_rank]
            log.info("worker %s (epoch %d, %s %s) -> replica %d pp_rank %d tp_rank %d layers "
                     "[%d, %d), %s", worker_id, epoch, device, cpu_level, replica.replica_id,
                     pp_rank, tp_rank, first, end, replica.dtype)
            return Placement(replica.replica_id, pp_rank, tp_rank, self.config.pp_size,
                             self.config.tp_size, first, end, replica.output_address,
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
        replica = Replica(replica_id, self.config.pp_size * self.config.tp_size,
                          free_address(self.config.advertise_host))
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
        engine_config = engine_config_for(replica, num_blocks, self.config, self.sched_config,
                                          self.model, self.epoch)
        replica.engine = self.engines.start_engine(replica, engine_config)
        replica.state = ReplicaState.STARTING

    def engine_report(self, report: EngineReport) -> None:
        """An engine core's report (the hub's thread): ready, counters, or down."""
        changed = False
        with self._lock:
            replica = self.replicas.get(report.replica_id)
            engine = replica.engine if replica is not None else None
            if engine is None or engine.epoch != report.engine_epoch:
                return                       # an engine core of an earlier replica
            was = (engine.ready, engine.kv_ok)
            engine.take_report(report)
            changed = was != (engine.ready, engine.kv_ok)
            if engine.ready and replica.state == ReplicaState.STARTING:
                replica.state = ReplicaState.READY
                log.info("replica %d ready", replica.replica_id)
                changed = True
            if engine.down_reason is not None and replica.state != ReplicaState.DOWN:
                self._engine_gone_locked(replica, engine, engine.down_reason, dropped=True)
                changed = True
        if changed:
            self.on_change()

    def check_engines(self) -> None:
        """Engine cores that exited on their own take their replica down; one told to stop
        that is still there after the grace period is killed (the hub calls this often)."""
        changed = False
        with self._lock:
            for replica in list(self.replicas.values()):
                engine = replica.engine
                if engine is None:
                    continue
                if engine.overdue():
                    log.warning("replica %d: engine core did not stop in time; killing it",
                                replica.replica_id)
                    engine.kill()
                code = engine.exited()
                if code is None or engine.reaped:
                    continue
                engine.reaped = True
                if replica.state not in GONE_STATES:
                    reason = engine.down_reason or f"its engine core exited (code {code})"
                    # One that exited without saying so did not drop its pool.
                    self._engine_gone_locked(replica, engine, reason,
                                             dropped=engine.down_reason is not None)
                    changed = True
                elif engine.down_reason is None:
                    # Told to stop (its replica was lost) and killed, or killed before it was
                    # up: it never dropped its pool.
                    self.kv.drop_pool_of(replica.replica_id)
        if changed:
            self.on_change()

    def _engine_gone_locked(self, replica: Replica, engine: EngineProcess, reason: str,
                            dropped: bool) -> None:
        self._mark_down_locked(replica.replica_id, reason)
        self._gone.append((replica.replica_id, engine.epoch))
        if not dropped:
            self.kv.drop_pool_of(replica.replica_id)
        self._retire_locked()

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

    def _replica_lost_locked(self, replica_id: int, reason: str) -> None:
        """Take a replica down; its engine core (if any) is told to stop, and tells its front
        ends, which move its requests."""
        replica = self.replicas.get(replica_id)
        if replica is None or replica.state == ReplicaState.DOWN:
            return
        self._mark_down_locked(replica_id, reason)
        if replica.engine is not None:
            self._gone.append((replica_id, replica.engine.epoch))
            self.engines.stop_engine(replica.engine, reason)
        self._retire_locked()

    def _mark_down_locked(self, replica_id: int, reason: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None or replica.state == ReplicaState.DOWN:
            return
        log.warning("replica %d down: %s", replica_id, reason)
        replica.state = ReplicaState.DOWN
        # The surviving ranks learn it from their next heartbeat and register again.
        for record in replica.workers:
            record.state = WorkerState.DOWN
        self._seq += 1

    def _retire_locked(self) -> None:
        """Only the last MAX_DOWN_REPLICAS down replicas (and their workers) stay listed:
        churn must not grow memory unbounded. One whose engine core still runs stays."""
        down = [r for r in self.replicas.values() if r.state == ReplicaState.DOWN
                and (r.engine is None or r.engine.exited() is not None)]
        for old in down[:max(0, len(down) - MAX_DOWN_REPLICAS)]:
            del self.replicas[old.replica_id]
            for record in old.workers:
                if self.workers.get(record.worker_id) is record:
                    del self.workers[record.worker_id]

    def replica_list(self) -> list[Replica]:
        with self._lock:
            return list(self.replicas.values())

    def ready_replicas(self) -> list[Replica]:
        return [r for r in list(self.replicas.values())
                if r.state == ReplicaState.READY and r.engine is not None and r.engine.kv_ok
                and r.engine.command_address is not None]

    def is_ready(self) -> bool:
        """Readiness: a replica can serve and kvcache_svc answers."""
        return self.kv.reachable and bool(self.ready_replicas())

    def cluster_state(self) -> ClusterState:
        """What the front ends route by (the hub answers every report with it)."""
        with self._lock:
            ready = [ReplicaEntry(r.replica_id, r.engine.epoch, r.engine.command_address,
                                  r.engine.config.num_kv_blocks)
                     for r in self.ready_replicas()
                     if r.engine is not None and r.engine.command_address is not None]
            gone = list(self._gone)
            seq = self._seq
        return ClusterState(seq=seq, ready=ready, kv_reachable=self.kv.reachable,
                            draining=self.draining, max_kv_tokens=self.max_kv_tokens(),
                            served_dtype=self.served_dtype(), gone=gone)

    # ------------------------------------------------------------------ monitor

    def _monitor_loop(self) -> None:
        probe: RequestClient[FromKvCache] = RequestClient(self.ctx, Codec(FromKvCache),
                                                          self.config.kvcache_address)
        try:
            while not self._stop.wait(MONITOR_INTERVAL_S):
                try:
                    self._check_heartbeats()
                    self._watch_kvcache(probe)
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

    def _watch_kvcache(self, probe: RequestClient[FromKvCache]) -> None:
        if self.kv.probe(probe):
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
        return request_token_limit(self.sched_config, min(blocks))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the monitor, then every engine core: told to stop (it drops its pool),
        killed if still there after `timeout_s`. The hub must still run (it sends)."""
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(timeout=5)
        engines = [r.engine for r in list(self.replicas.values()) if r.engine is not None]
        stop_all(engines, lambda e: self.engines.stop_engine(e, "the scheduler is shutting down"),
                 timeout_s)

