"""`ShardRunner`: what the worker's service loop needs of the runner that serves its shard.

Two classes have it: `ModelRunner` (worker_svc.runner, the model) and `NullRunner`
(worker_svc.null_runner, a model that costs nothing, for measuring the host's work).
worker_svc.placement builds one of them per placement; worker_svc.server, step_loop and
stage_step drive it through this interface only.
"""

from typing import Protocol

import torch
import torch.distributed as dist

from services.kv_chunks import KvSlice
from services.model_config import ModelConfig
from services.wire import StepInput, StepOutput
from worker_svc.kv_loader import KvLoader
from worker_svc.kv_saver import KvSaver
from worker_svc.launched_step import LaunchedStep, StageActivations
from worker_svc.memory_budget import KvBudget


class ShardRunner(Protocol):
    """A shard's runner, from placement (`measure_kv_budget`, `init_cache`) to its steps
    (`launch`, `finish`) and its end (`release_cache`, `close`); see `ModelRunner`."""

    config: ModelConfig
    dtype: torch.dtype              # the replica's compute dtype
    device: torch.device            # where stage activations live
    kv_saver: KvSaver | None        # None: no KV store
    kv_loader: KvLoader | None

    def kv_slice(self) -> KvSlice: ...

    def rejoin(self, tp_group: "dist.ProcessGroup | None") -> None: ...

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int: ...

    def describe_kv(self) -> str: ...

    def measure_kv_budget(self, block_size: int, max_num_batched_tokens: int,
                          max_num_seqs: int, cpu_cap_bytes: int | None,
                          gpu_memory_utilization: float = 0.9) -> KvBudget: ...

    def init_cache(self, num_blocks: int, block_size: int, max_num_seqs: int = 256) -> None: ...

    def release_cache(self) -> None: ...

    def close(self) -> None: ...

    def launch(self, step: StepInput, stage_input: StageActivations | None = None
               ) -> LaunchedStep: ...

    def finish(self, launched: LaunchedStep) -> StepOutput | StageActivations: ...

    def execute(self, step: StepInput, stage_input: StageActivations | None = None
                ) -> StepOutput | StageActivations: ...

    def failed_output(self, step: StepInput, exc: Exception) -> StepOutput: ...
