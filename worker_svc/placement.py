"""The shard this worker serves, across placements: load it for a placement (or keep the one
loaded when the new placement is the same shard), measure the KV blocks it fits, allocate the
replica's KV cache on InitCache, and close it when another shard replaces it or the process
ends.

`WorkerServer` (worker_svc.server) calls `place` after each registration and `drop` at exit;
its step loop (worker_svc.step_loop) calls `init_cache`; the heartbeat reads the KV saver's
counters through `kv_saver`. The registration protocol itself stays in the server: this
module sees a placement only as the `RegisterResponse` that carries it.

The shard's runner is a `ModelRunner` (worker_svc.runner), or with `--null-model` a
`NullRunner` (worker_svc.null_runner: no weights, nothing computed), which serves one rank
only: a placement of more pipeline stages or tensor-parallel ranks is refused.
"""

import gc
import logging
import time
from typing import TYPE_CHECKING

import torch

from services.channels import Sender
from services.model_config import ModelConfig, load_model_config
from services.rpc.splitserve.v1 import control_pb2
from services.wire import CacheReady, InitCache, WorkerFailure
from worker_svc.config import WorkerConfig
from worker_svc.device import DeviceError, dtype_for
from worker_svc.kv_saver import KvSaver, KvStoreOptions
from worker_svc.null_runner import NullRunner
from worker_svc.parallel import ParallelGroups
from worker_svc.runner import ModelRunner
from worker_svc.shard_runner import ShardRunner

if TYPE_CHECKING:
    from worker_svc.model.tensor_parallel import TpGroup

log = logging.getLogger(__name__)


class Placer:
    """Holds the loaded shard (its runner) and the placement key it was loaded for."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        # The loaded shard, kept across registrations while the placement's key is the same.
        self._runner: ShardRunner | None = None
        self._runner_key: tuple[object, ...] | None = None

    @property
    def runner(self) -> ShardRunner | None:
        return self._runner

    @property
    def kv_saver(self) -> KvSaver | None:
        """The kept runner's KV saver, whose counters ride on heartbeats (None: no saving).
        Read from the heartbeat's thread: one attribute read of each, no lock needed."""
        runner = self._runner
        return None if runner is None else runner.kv_saver

    def place(self, placement: control_pb2.RegisterResponse, link: ParallelGroups | None,
              ) -> tuple[ShardRunner, int] | None:
        """The runner for `placement` and the KV blocks it can hold, measured afresh. A
        runner kept from the last placement (the same shard) first frees its KV cache,
        graphs and staging buffers, or the measurement would count them as taken; one of
        another shard is closed (its threads too) before the new shard loads. None: the
        shard cannot be served here."""
        key = (placement.first_layer, placement.end_layer, placement.pp_size,
               placement.tp_rank, placement.tp_size, placement.dtype,
               placement.kv_cache_dtype, placement.quantization)
        runner = self._runner
        if runner is not None and key != self._runner_key:
            self.drop()
            runner = None
        if runner is None:
            runner = self._load(placement, link)
            if runner is None:
                return None
            self._runner, self._runner_key = runner, key
        else:
            runner.release_cache()
            if link is not None:
                runner.rejoin(link.tp_group)     # same slice, new process group
        return runner, self._capacity(runner, placement)

    def drop(self) -> None:
        """Closes the kept runner (its KV cache, its saver's and loader's threads)."""
        if self._runner is not None:
            self._runner.close()
        self._runner, self._runner_key = None, None
        gc.collect()           # the weights go before another shard loads

    def init_cache(self, runner: ShardRunner, message: InitCache, num_blocks: int,
                   outputs: Sender, placement: control_pb2.RegisterResponse) -> None:
        """Allocate the replica's KV cache, or refuse (WorkerFailure: the replica does not come
        up, and the scheduler logs why) a size this worker cannot hold: a cache past the
        measured budget would fail later, mid-step, or take the host's memory."""
        cfg = self.config
        problem = None
        if message.block_size != placement.block_size:
            problem = (f"InitCache block size {message.block_size} differs from the "
                       f"registration's {placement.block_size}")
        elif not 2 <= message.num_blocks <= num_blocks:
            problem = (f"InitCache asks for {message.num_blocks} KV blocks; this worker holds "
                       f"2..{num_blocks} (its budget: --kv-cache-memory-gib on a CPU, "
                       f"--gpu-memory-utilization on a GPU; the scheduler's --num-kv-blocks)")
        if problem is None:
            try:
                runner.init_cache(message.num_blocks, message.block_size,
                                  placement.max_num_seqs or 256)
            except (RuntimeError, ValueError) as exc:     # torch's out-of-memory included
                problem = f"allocating {message.num_blocks} KV blocks failed: {exc}"
        if problem is not None:
            log.error("%s", problem)
            outputs.send(WorkerFailure(worker_id=cfg.worker_id, step_id=0,
                                       message=problem[:4000]))
            return
        log.info("KV cache allocated: %d blocks of %d tokens (replica-wide choice; this worker "
                 "fits %d)", message.num_blocks, message.block_size, num_blocks)
        outputs.send(CacheReady(worker_id=cfg.worker_id, num_blocks=message.num_blocks))

    def _load(self, placement: control_pb2.RegisterResponse,
              link: ParallelGroups | None) -> ShardRunner | None:
        """Builds the runner for `placement` whole: its TP slice, its test hooks, its KV
        store link. None (logged): this worker cannot serve that shard."""
        from worker_svc.model.tensor_parallel import TpGroup, TpShard

        cfg = self.config
        model = load_model_config(cfg.model_path)
        if cfg.null_model is not None:
            return self._load_null(placement, model)
        tp = None
        if placement.tp_size > 1:
            assert link is not None and link.tp_group is not None
            try:
                shard = TpShard.build(placement.tp_rank, placement.tp_size, model.num_heads,
                                      model.num_kv_heads, model.intermediate_size,
                                      model.vocab_size)
            except ValueError as exc:
                log.error("cannot shard %s: %s", model.name, exc)
                return None
            tp = TpGroup(link.tp_group, shard)
            log.info("tp_rank %d/%d holds query heads [%d, %d), KV heads [%d, %d), MLP "
                     "columns [%d, %d), vocabulary rows [%d, %d)", placement.tp_rank,
                     placement.tp_size, *shard.q_heads, *shard.kv_heads, *shard.intermediate,
                     *shard.vocab)
        started = time.monotonic()
        try:
            dtype = dtype_for(cfg.device, placement.dtype)
        except DeviceError as exc:
            log.error("cannot serve this replica: %s", exc)
            return None
        try:
            runner = self._runner_for(placement, model, dtype, tp)
        except ValueError as exc:        # e.g. --quantization int8 at a level without it
            log.error("cannot serve this replica: %s", exc)
            return None
        if cfg.fail_request_prefix is not None:
            log.warning("test fault injection on: steps with a request id starting with %r "
                        "fail", cfg.fail_request_prefix)
        log.info("loaded layers [%d, %d) in %.1fs (%.2f GiB of weights)", placement.first_layer,
                 placement.end_layer, time.monotonic() - started,
                 runner.weight_bytes / (1 << 30))
        return runner

    def _runner_for(self, placement: control_pb2.RegisterResponse, model: ModelConfig,
                    dtype: torch.dtype, tp: "TpGroup | None") -> ModelRunner:
        """The model runner of `placement`'s shard (ValueError: settings it cannot serve)."""
        cfg = self.config
        return ModelRunner(model, cfg.model_path, dtype, cfg.worker_id,
                           first_layer=placement.first_layer, end_layer=placement.end_layer,
                           is_last_stage=placement.pp_rank == placement.pp_size - 1,
                           quant_kernels=cfg.quant_kernels, tp=tp,
                           cpu_level=cfg.cpu_level, device=cfg.device,
                           enforce_eager=cfg.enforce_eager,
                           fail_request_prefix=cfg.fail_request_prefix,
                           kv_store=KvStoreOptions(cfg.kv_store) if cfg.kv_store else None,
                           kv_cache_dtype=placement.kv_cache_dtype or "auto",
                           quantization=placement.quantization)

    def _load_null(self, placement: control_pb2.RegisterResponse,
                   model: ModelConfig) -> NullRunner | None:
        """The null model for `placement` (one rank of one stage only). None (logged): more
        ranks, or a dtype this worker refuses."""
        cfg = self.config
        assert cfg.null_model is not None
        if placement.pp_size > 1 or placement.tp_size > 1:
            log.error("cannot serve this replica: --null-model runs one rank (pp 1, tp 1), "
                      "placed as pp_rank %d/%d tp_rank %d/%d", placement.pp_rank,
                      placement.pp_size, placement.tp_rank, placement.tp_size)
            return None
        try:
            dtype = dtype_for(cfg.device, placement.dtype)
        except DeviceError as exc:
            log.error("cannot serve this replica: %s", exc)
            return None
        log.warning("null model: no weights loaded, nothing computed; tokens echo the prompt, "
                    "each step takes %.2f ms of an emulated device (%s)",
                    cfg.null_model.step_ms, cfg.null_model)
        return NullRunner(model, dtype, cfg.worker_id, cfg.null_model)

    def _capacity(self, runner: ShardRunner, placement: control_pb2.RegisterResponse) -> int:
        """Blocks this worker can hold, from measured memory (logged term by term)."""
        cfg = self.config
        budget = runner.measure_kv_budget(
            placement.block_size, placement.max_num_batched_tokens or 2048,
            placement.max_num_seqs or 256, cfg.kv_cache_bytes, cfg.gpu_memory_utilization)
        per_block = runner.kv_bytes_per_block(placement.block_size)
        num_blocks = runner.num_blocks_for_budget(budget.budget, placement.block_size)
        log.info("%s; fits %d blocks of %d tokens (%d bytes each: %s)", budget.describe(),
                 num_blocks, placement.block_size, per_block, runner.describe_kv())
        return num_blocks
