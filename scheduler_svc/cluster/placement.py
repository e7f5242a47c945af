"""What a replica is made of: worker records, their placement as (pp_rank, tp_rank), the
stage layer ranges, the replica's rendezvous and the address its ranks send outputs to, the
configuration its engine core starts with and the longest request its pool holds. Plain
data and arithmetic; `Membership` (membership.py) decides who goes where and when a replica
starts or goes down.
"""

import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from scheduler_svc.config import ServerConfig
from scheduler_svc.engine.config import EngineConfig, SchedulerConfig
from services.kv_groups import max_tokens_per_request
from services.kv_store_wire import KvSlice
from services.model_config import ModelConfig

if TYPE_CHECKING:   # plain data: the engine core's handle is only named here
    from scheduler_svc.cluster.engines import EngineProcess


class RegistrationError(ValueError):
    """A registration the cluster refuses (wrong model, stale epoch, unknown worker)."""


class WorkerState(StrEnum):
    """A registered worker: loading its shard, ready (capacity reported), or down."""
    LOADING = "loading"
    READY = "ready"
    DOWN = "down"


class ReplicaState(StrEnum):
    """forming -> starting -> ready -> down; or forming -> refused (its workers cannot hold
    the KV pool: no engine, the ranks stay idle until one registers again)."""
    FORMING = "forming"
    STARTING = "starting"
    READY = "ready"
    DOWN = "down"
    REFUSED = "refused"


GONE_STATES = (ReplicaState.DOWN, ReplicaState.REFUSED)   # replicas that serve no more


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
    state: WorkerState = WorkerState.LOADING
    cpu_level: str = ""                 # the kernel level it reported ("" for a GPU)
    device_uuid: str = ""               # its GPU's CUDA uuid ("" on the CPU)
    kv_slice: KvSlice | None = None     # its part of the KV in the store (None: no store)
    num_kv_chunks_stored: int = 0       # its KV saver's counters, from its heartbeats
    num_kv_saves_skipped: int = 0
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
    dtype: str                  # the replica's compute dtype


def gpu_taken_message(device_uuid: str, holder: WorkerRecord, worker_id: str) -> str:
    """Why `worker_id` may not join: `holder`, a live worker, already computes on its GPU."""
    return (f"GPU uuid {device_uuid} is already used by worker {holder.worker_id} (replica "
            f"{holder.replica_id}, pp_rank {holder.pp_rank}, tp_rank {holder.tp_rank}); "
            f"refusing worker {worker_id}: each rank of a replica needs its own GPU (one GPU "
            f"cannot host two NCCL ranks, and two workers would both size their KV cache from "
            f"its whole memory). Give every worker its own device, e.g. --device cuda:N or "
            f"CUDA_VISIBLE_DEVICES per worker.")


MIN_KV_BLOCKS = 2     # block 0 is the null block: a pool needs one more to hold any token


def kv_blocks_problem(workers: list[WorkerRecord], num_kv_blocks: int | None) -> str | None:
    """Why a replica of `workers` cannot have a pool of `num_kv_blocks` KV blocks (the
    `--num-kv-blocks` override; None: the smallest worker's measure), or None if it can.

    Checked before InitCache: past its budget a worker would over-allocate (or refuse, which
    takes the replica down and has its ranks register again, over and over), and a pool
    under 2 blocks fails the wire's validation with a message naming neither cause nor fix."""

    def fits(w: WorkerRecord) -> str:
        n = w.num_kv_blocks or 0
        return f"worker {w.worker_id} fits {n} KV block{'' if n == 1 else 's'}"

    def more_memory(short: list[WorkerRecord]) -> str:
        who = "the worker" if len(short) == 1 else "those workers"
        return (f"give {who} more KV memory (--kv-cache-memory-gib on a CPU worker, "
                f"--gpu-memory-utilization on a GPU worker)")

    tiny = [w for w in workers if (w.num_kv_blocks or 0) < MIN_KV_BLOCKS]
    if tiny:
        return (f"{', '.join(map(fits, tiny))}; a pool needs at least {MIN_KV_BLOCKS} "
                f"(block 0 is the null block): {more_memory(tiny)}; --num-kv-blocks cannot go "
                f"past what a worker fits")
    if num_kv_blocks is None:
        return None
    short = [w for w in workers if (w.num_kv_blocks or 0) < num_kv_blocks]
    if not short:
        return None
    most = min(w.num_kv_blocks or 0 for w in short)
    return (f"--num-kv-blocks {num_kv_blocks} is more than {', '.join(map(fits, short))} for "
            f"its layers: lower --num-kv-blocks to at most {most}, or {more_memory(short)}")


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


def free_address(host: str) -> str:
    """A ZMQ address on `host` at a port free now: where a replica's ranks will send their
    outputs, bound by its engine core once the replica is complete (its workers load their
    shards meanwhile, and send nothing before the engine core's InitCache)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class Replica:
    """The ranks of one replica and, once complete, its engine core."""

    def __init__(self, replica_id: int, size: int, output_address: str) -> None:
        self.replica_id = replica_id
        self.ranks: list[WorkerRecord | None] = [None] * size
        self.output_address = output_address    # where its ranks send (free_address)
        self.dist_init_method = ""      # set when rank 0 registers (multi-rank replicas)
        self.dtype = ""                 # set when its first rank registers
        self.engine: EngineProcess | None = None
        self.state = ReplicaState.FORMING

    @property
    def workers(self) -> list[WorkerRecord]:
        return [w for w in self.ranks if w is not None]

    def is_full(self) -> bool:
        return all(w is not None for w in self.ranks)

    def seat(self, record: WorkerRecord, tp_size: int) -> tuple[int, int]:
        """`record` takes the next free rank; its (pp_rank, tp_rank), set in it. Rank 0 of a
        multi-rank replica names its rendezvous."""
        rank = self.ranks.index(None)
        record.pp_rank, record.tp_rank = divmod(rank, tp_size)
        self.ranks[rank] = record
        if rank == 0 and len(self.ranks) > 1:
            self.dist_init_method = rendezvous_address(record.step_address)
        return record.pp_rank, record.tp_rank


def gpu_holder(workers: Iterable[WorkerRecord], device_uuid: str,
               worker_id: str) -> WorkerRecord | None:
    """The live worker other than `worker_id` that computes on GPU `device_uuid`.

    One GPU, one worker: a registration whose GPU (its non-empty `device_uuid`) another live
    worker holds is refused, in any replica, not only its own. Two ranks of one replica cannot
    share a GPU (NCCL refuses two ranks on one device), and two workers of different replicas
    on one GPU would each size their KV cache from its whole memory. CPU workers report no
    uuid and may share a host. The holder stops counting once it is down (heartbeat timeout,
    lost replica); the same worker id registering again with a newer epoch replaces itself."""
    if not device_uuid:
        return None
    for record in workers:
        if (record.device_uuid == device_uuid and record.worker_id != worker_id
                and record.state != WorkerState.DOWN):
            return record
    return None


def replica_dtype(configured: str, preferred: str) -> str:
    """A new replica's dtype: the scheduler's --dtype, or with auto its first rank's choice."""
    if configured != "auto":
        return configured
    return preferred if preferred in ("float32", "bfloat16") else "float32"


def store_slices(workers: list[WorkerRecord]) -> tuple[KvSlice, ...]:
    """The replica's slices of its KV in the store, in rank order; empty (no loads) unless
    every rank uses the store."""
    slices = [w.kv_slice for w in workers]
    if any(kv_slice is None for kv_slice in slices):
        return ()
    return tuple(kv_slice for kv_slice in slices if kv_slice is not None)


def engine_config_for(replica: Replica, num_blocks: int, config: ServerConfig,
                      sched_config: SchedulerConfig, model: ModelConfig,
                      scheduler_epoch: int) -> EngineConfig:
    """What the replica's engine core runs with, its pool `num_blocks` blocks."""
    return EngineConfig(
        replica_id=replica.replica_id, scheduler=sched_config, num_kv_blocks=num_blocks,
        kv_timeout_s=config.kv_timeout_s, step_timeout_s=config.step_timeout_s,
        ship_sampled_tokens=config.pp_size > 1,
        max_batches_in_flight=config.max_batches_in_flight or config.pp_size,
        async_scheduling=config.async_scheduling, scheduler_epoch=scheduler_epoch,
        store_slices=store_slices(replica.workers),
        eos_token_ids=tuple(model.eos_token_ids), vocab_size=model.vocab_size)


def request_token_limit(sched_config: SchedulerConfig, num_blocks: int) -> int:
    """Tokens one request can hold in a pool of `num_blocks` blocks: every KV group counted,
    a sliding group holding at most a window of blocks (the replica's scheduler checks again,
    with the KV store's chunks kept)."""
    sc = sched_config
    max_step = sc.token_budget
    if sc.chunked_prefill and sc.long_prefill_token_threshold > 0:
        max_step = min(max_step, sc.long_prefill_token_threshold)
    return max_tokens_per_request(sc.kv_group_windows, num_blocks - 1, sc.block_size, max_step)
