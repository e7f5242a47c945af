"""Workers, replicas and routing: who is registered, how ranks form replicas, where a new
request goes.

A worker registers (id, epoch, device, memory, step address) and is placed in the replica
being formed as the next free (pp_rank, tp_rank). After loading its shard it reports how many
KV blocks fit its own layers; when every rank has reported, the replica uses the minimum (or
the `--num-kv-blocks` override), and its `ReplicaEngine` brings the pool and caches up.
"""

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from scheduler_svc.config import SchedulerConfig, ServerConfig
from scheduler_svc.engine import EngineConfig, ReplicaEngine
from scheduler_svc.tokenizer import TextTokenizer
from services.channels import Receiver, tcp_address
from services.codec import Codec
from services.model_config import ModelConfig
from services.wire import FromWorker

log = logging.getLogger(__name__)


class RegistrationError(ValueError):
    """A registration the cluster refuses (wrong model, stale epoch, unknown worker)."""


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    epoch: int
    device: str
    memory_bytes: int
    step_address: str
    replica_id: int
    pp_rank: int
    tp_rank: int
    num_kv_blocks: int | None = None
    state: str = "loading"              # loading -> ready -> down
    last_heartbeat: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class Placement:
    replica_id: int
    pp_rank: int
    tp_rank: int
    pp_size: int
    tp_size: int
    first_layer: int
    end_layer: int
    output_address: str
    dist_init_method: str       # torch.distributed rendezvous of the replica ("" if one rank)


def split_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous stage ranges; the first `num_layers % pp_size` stages get one layer more."""
    base, extra = divmod(num_layers, pp_size)
    ranges, start = [], 0
    for stage in range(pp_size):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def rendezvous_address(rank0_step_address: str) -> str:
    """A torch.distributed TCP rendezvous on rank 0's host. The port is picked free on this
    host, which is rank 0's host when the cluster runs on one machine; across machines rank 0
    may have to be started with a known free port range (not handled yet)."""
    host = rank0_step_address.removeprefix("tcp://").rsplit(":", 1)[0]
    with socket.socket() as s:
        s.bind(("", 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class Replica:
    """The ranks of one replica and, once complete, its engine."""

    def __init__(self, replica_id: int, size: int, outputs: Receiver[FromWorker]) -> None:
        self.replica_id = replica_id
        self.ranks: list[WorkerRecord | None] = [None] * size
        self.outputs = outputs
        self.dist_init_method = ""      # set when rank 0 registers (multi-rank replicas)
        self.engine: ReplicaEngine | None = None
        self.state = "forming"          # forming -> starting -> ready -> down

    @property
    def workers(self) -> list[WorkerRecord]:
        return [w for w in self.ranks if w is not None]

    def is_full(self) -> bool:
        return all(w is not None for w in self.ranks)


class Cluster:
    def __init__(self, config: ServerConfig, sched_config: SchedulerConfig, model: ModelConfig,
                 tokenizer: TextTokenizer, ctx: zmq.Context,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.sched_config = sched_config
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.on_change = on_change      # readiness may have changed (called from any thread)
        self._lock = threading.Lock()
        self.replicas: dict[int, Replica] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self._next_replica_id = 0
        self._layer_ranges = split_layers(model.num_layers, config.pp_size)

    # ------------------------------------------------------------------ registration

    def register(self, worker_id: str, epoch: int, device: str, memory_bytes: int,
                 step_address: str, model: str) -> Placement:
        if model and model != self.model.name:
            raise RegistrationError(f"worker serves {model!r}; this cluster serves "
                                    f"{self.model.name!r}")
        with self._lock:
            old = self.workers.get(worker_id)
            if old is not None and epoch <= old.epoch:
                raise RegistrationError(
                    f"worker {worker_id} epoch {epoch} is not newer than {old.epoch}")
            if old is not None:
                self._mark_down_locked(old.replica_id, f"worker {worker_id} restarted")
            replica = self._forming_replica_locked()
            rank = replica.ranks.index(None)
            pp_rank, tp_rank = divmod(rank, self.config.tp_size)
            record = WorkerRecord(worker_id, epoch, device, memory_bytes, step_address,
                                  replica.replica_id, pp_rank, tp_rank)
            replica.ranks[rank] = record
            self.workers[worker_id] = record
            if rank == 0 and len(replica.ranks) > 1:
                replica.dist_init_method = rendezvous_address(step_address)
            first, end = self._layer_ranges[pp_rank]
            log.info("worker %s (epoch %d, %s) -> replica %d pp_rank %d tp_rank %d layers "
                     "[%d, %d)", worker_id, epoch, device, replica.replica_id, pp_rank, tp_rank,
                     first, end)
            return Placement(replica.replica_id, pp_rank, tp_rank, self.config.pp_size,
                             self.config.tp_size, first, end, replica.outputs.address,
                             replica.dist_init_method)

    def _forming_replica_locked(self) -> Replica:
        for replica in self.replicas.values():
            if replica.state == "forming" and not replica.is_full():
                return replica
        replica_id = self._next_replica_id
        self._next_replica_id += 1
        outputs: Receiver[FromWorker] = Receiver(
            self.ctx, Codec(FromWorker), tcp_address(self.config.advertise_host, 0))
        replica = Replica(replica_id, self.config.pp_size * self.config.tp_size, outputs)
        self.replicas[replica_id] = replica
        return replica

    def report_capacity(self, worker_id: str, epoch: int, num_kv_blocks: int) -> None:
        with self._lock:
            record = self._known_locked(worker_id, epoch)
            record.num_kv_blocks = num_kv_blocks
            record.state = "ready"
            log.info("worker %s fits %d KV blocks for its layers", worker_id, num_kv_blocks)
            replica = self.replicas[record.replica_id]
            if replica.state != "forming" or not replica.is_full():
                return
            if any(w.num_kv_blocks is None for w in replica.workers):
                return
            self._start_replica_locked(replica)

    def _start_replica_locked(self, replica: Replica) -> None:
        measured = min(w.num_kv_blocks or 0 for w in replica.workers)
        num_blocks = self.config.num_kv_blocks or measured
        log.info("replica %d: ranks measured %s KV blocks; using %d%s", replica.replica_id,
                 [w.num_kv_blocks for w in replica.workers], num_blocks,
                 " (--num-kv-blocks)" if self.config.num_kv_blocks else " (minimum)")
        engine_config = EngineConfig(
            replica_id=replica.replica_id, scheduler=self.sched_config, num_kv_blocks=num_blocks,
            kvcache_address=self.config.kvcache_address, kv_timeout_s=self.config.kv_timeout_s,
            step_timeout_s=self.config.step_timeout_s,
            ship_sampled_tokens=self.config.pp_size > 1,
            max_batches_in_flight=self.config.max_batches_in_flight or self.config.pp_size,
            async_scheduling=self.config.async_scheduling)
        # Every rank gets every StepInput, ordered by rank.
        addresses = [w.step_address for w in replica.ranks if w is not None]
        replica.engine = ReplicaEngine(engine_config, self.tokenizer, self.model.eos_token_ids,
                                       self.ctx, addresses, replica.outputs, self._on_engine_down)
        replica.state = "starting"
        replica.engine.start()
        threading.Thread(target=self._await_ready, args=(replica,), daemon=True).start()

    def _await_ready(self, replica: Replica) -> None:
        engine = replica.engine
        assert engine is not None
        while not engine.ready.wait(0.5):
            if replica.state != "starting":
                return
        with self._lock:
            if replica.state == "starting":
                replica.state = "ready"
        self.on_change()

    def heartbeat(self, worker_id: str, epoch: int) -> bool:
        with self._lock:
            record = self.workers.get(worker_id)
            if record is None or record.epoch != epoch or record.state == "down":
                return False
            record.last_heartbeat = time.monotonic()
            return True

    def _known_locked(self, worker_id: str, epoch: int) -> WorkerRecord:
        record = self.workers.get(worker_id)
        if record is None or record.epoch != epoch:
            raise RegistrationError(f"unknown worker {worker_id} epoch {epoch}; register first")
        return record

    # ------------------------------------------------------------------ replica life

    def _on_engine_down(self, replica_id: int, reason: str) -> None:
        with self._lock:
            self._mark_down_locked(replica_id, reason)
        self.on_change()

    def _mark_down_locked(self, replica_id: int, reason: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None or replica.state == "down":
            return
        log.warning("replica %d down: %s", replica_id, reason)
        replica.state = "down"
        for record in replica.workers:
            record.state = "down"

    def ready_replicas(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state == "ready" and r.engine is not None]

    def pick_replica(self) -> ReplicaEngine | None:
        """The ready replica with the least live requests (prefix-aware routing: issue 4)."""
        ready = self.ready_replicas()
        if not ready:
            return None
        best = min(ready, key=lambda r: (r.engine.num_live if r.engine else 0, r.replica_id))
        return best.engine

    def max_kv_tokens(self) -> int | None:
        """Tokens one request can hold on the smallest ready replica (None: none ready)."""
        sizes = [(r.engine.config.num_kv_blocks - 1) * self.sched_config.block_size
                 for r in self.ready_replicas() if r.engine is not None]
        return min(sizes) if sizes else None

    def shutdown(self) -> None:
        for replica in list(self.replicas.values()):
            if replica.engine is not None:
                replica.engine.stop()
            replica.outputs.close()
