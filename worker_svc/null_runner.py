"""`NullRunner`: a runner with `ModelRunner`'s interface that loads no weights and computes
nothing, so that the cluster's host work (scheduler, kvcache_svc, the worker's own step path,
the clients) can be measured with the model costing nothing (`python -m worker_svc
--null-model`; bench/host_ceiling.py).

Built by worker_svc.placement instead of `ModelRunner` when the worker's config carries
`NullModelOptions`; driven by the same step loop (worker_svc.step_loop, with its launch-ahead
`overlap` on: worker_svc.server) and answering the same messages.

What it keeps of a real step, on the host: the diff applied to a real `InputBatch` (the same
validation: a bad diff raises ValueError and leaves the batch as it was), the step's layout
(one-token queries first), the attention metadata of every KV group built on the CPU exactly
as `ModelRunner` builds it (`NullModelOptions.metadata` off skips only that), the input ids
(greedy tokens of a step launched ahead still pending, worker_svc.pending_tokens), and a real
`StepOutput` with real `StepTimings`. The tokens follow worker_svc.null_sampler's rules.

What it emulates: the device. A step's work takes `step_ms` on a queue (worker_svc.null_device)
that starts when the host has prepared the step and the step before is done; `ready()` is
False and `finish` sleeps until then. Its timings: `prepare_ms` the host's launch, `forward_ms`
`step_ms`, `gap_ms` the emulated device's idle time before the step. `step_ms` 0 measures the
host's ceiling; 1.92 at 64 rows stands in for an H100 on a small model.

KV: capacity is reported from `--kv-cache-memory-gib` and the model's real page size, so block
counts are those of a real worker with that budget, but no KV tensor is allocated. No KV store:
`kv_saver` and `kv_loader` are None, and a step that asks to load KV is refused. One pipeline
stage and one tensor-parallel rank only (placement refuses more).
"""

import logging
import time
from dataclasses import dataclass

import torch

from services.kv_chunks import KvSlice
from services.kv_groups import KvGroupLayout
from services.model_config import ModelConfig
from services.wire import StepInput, StepOutput
from worker_svc.attention import AttentionMetadata
from worker_svc.input_batch import InputBatch, ScheduledRequest, kernel_metadata
from worker_svc.kv_cache import KvLayerSpec, bytes_per_block
from worker_svc.kv_loader import KvLoader
from worker_svc.kv_saver import KvSaver
from worker_svc.launched_step import LaunchedStep, SampledTokens, StageActivations
from worker_svc.memory_budget import KvBudget, cpu_budget
from worker_svc.null_device import EmulatedDevice, NullLaunchedStep
from worker_svc.null_sampler import NullSampler
from worker_svc.pending_tokens import PendingTokens
from worker_svc.step_output import failed_output, step_output

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NullModelOptions:
    """`--null-model`'s settings (worker_svc.config, parsed by worker_svc.__main__)."""

    step_ms: float = 0.0       # emulated device time per step, in milliseconds
    eos_step: int = 0          # K > 0: the EOS share samples EOS as its K-th output token
    eos_share: float = 1.0     # share of requests (by a hash of their id) that do, in [0, 1]
    metadata: bool = True      # build every step's attention metadata, as the real runner


class NullRunner:
    """`ModelRunner`'s interface over a model that costs nothing (module docstring)."""

    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, worker_id: str,
                 options: NullModelOptions) -> None:
        """`dtype`: the replica's compute dtype, which only sizes the KV pages here."""
        if options.step_ms < 0 or not 0.0 <= options.eos_share <= 1.0 or options.eos_step < 0:
            raise ValueError(f"null model options out of range: {options}")
        self.device = torch.device("cpu")        # where its metadata and input ids are built
        self.config = model_config
        self.dtype = dtype
        self.worker_id = worker_id
        self.options = options
        self.is_last_stage = True
        self.weight_bytes = 0
        self.kv_layout = KvGroupLayout.from_windows(model_config.layer_windows)
        self.input_batch: InputBatch | None = None
        # The token ids the last step fed the model, for inspection in tests.
        self.last_input_ids: torch.Tensor | None = None
        # No KV store: nothing is computed, so there is nothing to save or load.
        self.kv_saver: KvSaver | None = None
        self.kv_loader: KvLoader | None = None
        self._sampler = NullSampler(model_config.eos_token_ids, model_config.vocab_size,
                                    options.eos_step, options.eos_share)
        self._pending_tokens = PendingTokens()   # greedy tokens of a step launched ahead
        self._device = EmulatedDevice()
        self._kv_written = False                 # the current step's emulated forward queued

    def kv_slice(self) -> KvSlice:
        """Its part of the model's KV, named apart from any real model's (it never stores)."""
        return KvSlice(f"null:{self.config.name}", str(self.dtype).removeprefix("torch."), 0,
                       self.config.num_layers, 0, self.config.num_kv_heads)

    def rejoin(self, tp_group: object) -> None:
        """A kept runner placed again: nothing to rejoin (one rank, no process group)."""

    # -------------------------------------------------------------------------------- KV cache

    def kv_layer_specs(self, block_size: int) -> list[KvLayerSpec]:
        """One spec per KV tensor a real worker of the whole model would hold."""
        cfg = self.config
        positions = self.kv_layout.positions(range(cfg.num_layers))
        return [KvLayerSpec(block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
                for _ in positions]

    def kv_bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.kv_layer_specs(block_size))

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        page_bytes = self.kv_layer_specs(block_size)[0].page_bytes
        return self.kv_layout.num_blocks(budget_bytes, page_bytes, range(self.config.num_layers))

    def describe_kv(self) -> str:
        return f"{self.kv_layout.describe()}; null model: no KV tensor is allocated"

    def measure_kv_budget(self, block_size: int, max_num_batched_tokens: int,
                          max_num_seqs: int, cpu_cap_bytes: int | None,
                          gpu_memory_utilization: float = 0.9) -> KvBudget:
        """The whole of `cpu_cap_bytes` (--kv-cache-memory-gib): nothing is measured, since
        nothing is allocated; the cap is the capacity the null model pretends to have."""
        if cpu_cap_bytes is None:
            raise ValueError("the null model's KV capacity is --kv-cache-memory-gib")
        return cpu_budget(cpu_cap_bytes, 0, 0, cpu_cap_bytes, margin=0)

    def init_cache(self, num_blocks: int, block_size: int, max_num_seqs: int = 256) -> None:
        """A fresh input batch over `num_blocks` notional blocks; no KV tensor."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), "
                             f"got {num_blocks}")
        self.input_batch = InputBatch(num_blocks, block_size, self.config.vocab_size,
                                      self.config.max_model_len, self.kv_layout.windows)
        self._pending_tokens.clear()
        self._device.reset()

    def release_cache(self) -> None:
        self.input_batch = None
        self._pending_tokens.clear()
        self._device.reset()

    def close(self) -> None:
        self.release_cache()

    # ------------------------------------------------------------------------------------ step

    def execute(self, step: StepInput, stage_input: StageActivations | None = None
                ) -> StepOutput | StageActivations:
        """Run one step and wait for its result (`launch`, then `finish`)."""
        return self.finish(self.launch(step, stage_input))

    def launch(self, step: StepInput, stage_input: StageActivations | None = None
               ) -> NullLaunchedStep:
        """Prepare one step on the host and queue its emulated work. If it raises, the step's
        requests are dropped from the input batch, as `ModelRunner.launch` drops them."""
        if self.input_batch is None:
            raise RuntimeError("launch() before init_cache()")
        if stage_input is not None:
            raise ValueError("the null model is one pipeline stage: no stage input")
        self._kv_written = False
        try:
            return self._launch(step, self.input_batch)
        except Exception:
            self.input_batch.discard(step)
            raise

    def finish(self, launched: LaunchedStep) -> StepOutput:
        """Wait for the emulated device to finish `launched` (this runner's launch); its
        `StepOutput`."""
        assert isinstance(launched, NullLaunchedStep)
        delay = launched.done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        try:
            return step_output(launched, self.worker_id, self._pending_tokens)
        except Exception:
            if self.input_batch is not None:
                self.input_batch.discard(launched.step)
            raise

    def failed_output(self, step: StepInput, exc: Exception) -> StepOutput:
        """The answer to `step` after `launch` or `finish` raised `exc`."""
        return failed_output(step, exc, self.worker_id, self._kv_written)

    def _launch(self, step: StepInput, input_batch: InputBatch) -> NullLaunchedStep:
        start = time.perf_counter()
        loading = [r.request_id for r in step.new_requests if r.num_load_tokens]
        if loading:
            raise ValueError(f"the null model has no KV store to load from (requests "
                             f"{loading[:4]})")
        scheduled = input_batch.apply(step)
        launched = NullLaunchedStep(step, scheduled)
        if not scheduled:
            return launched
        # As ModelRunner._launch: one-token queries first, then longer chunks by length.
        layout = sorted(scheduled, key=lambda s: (s.num_new_tokens != 1, -s.num_new_tokens))
        with torch.inference_mode():
            if self.options.metadata:
                self._attention_metadata(layout, input_batch)
            self.last_input_ids = self._pending_tokens.input_ids(layout, self.device)
        prepared = time.perf_counter()
        done_at, gap_ms = self._device.queue(prepared, self.options.step_ms / 1e3)
        self._kv_written = True
        launched.done_at = done_at
        launched.clock.num_tokens = sum(s.num_new_tokens for s in layout)
        launched.prompt_logprobs = self._sampler.prompt_logprobs(layout)
        self._sample(launched, [s for s in layout if s.samples])
        clock = launched.clock
        clock.prepare_ms = (time.perf_counter() - start) * 1e3
        clock.forward_ms = self.options.step_ms
        clock.gap_ms = gap_ms
        return launched

    def _sample(self, launched: NullLaunchedStep, sampling: list[ScheduledRequest]) -> None:
        """The sampling rows' tokens, kept as the real last stage keeps them: a step of plain
        greedy rows holds its tokens as pending (the next step launched ahead takes them from
        there), any other appends them to its requests at once."""
        if not sampling:
            return
        token_ids, logprobs = self._sampler.sample(sampling, launched.step.token_masks)
        launched.tokens = sampled = SampledTokens(sampling)
        if all(s.state.plain_greedy for s in sampling):
            self._pending_tokens.hold(sampled, torch.tensor(token_ids, dtype=torch.int64),
                                      self.device)
            return
        sampled.token_ids, sampled.logprobs = token_ids, logprobs
        for s, token_id in zip(sampling, token_ids, strict=True):
            s.state.token_ids.append(token_id)

    def _attention_metadata(self, layout: list[ScheduledRequest], input_batch: InputBatch
                            ) -> list[AttentionMetadata]:
        """As `ModelRunner._attention_metadata` on the kernel path (the C kernels' and the
        GPU's), built and dropped: its host cost is the point."""
        return kernel_metadata(layout, input_batch, self.device)
