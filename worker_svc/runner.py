"""`ModelRunner`: one worker's model shard, its KV cache and input batch; runs one step.

Built whole, once per placement, by worker_svc.placement (its model by
worker_svc.model_loader, its KV store link from `KvStoreOptions`); nothing is set on it from
outside afterwards. The worker's service loop owns the sockets and calls, in order:
`measure_kv_budget` (the capacity report: the runner states its `ShardFootprint` and hands its
profiling forward, worker_svc.profile_step, to worker_svc.memory_budget), `init_cache` (after
`InitCache`), then `launch` and `finish` once per `StepInput` (`execute` is the two back to
back). The last pipeline stage returns a
`StepOutput`; an earlier stage returns the `StageActivations` its caller sends to the next
stage, whose step takes them.

A step: apply the diff to the input batch, lay the requests out one-token queries first,
build every per-step tensor once (on the host, copied to the device; one attention metadata
per KV group, services.kv_groups: the groups' block tables differ), run the stage's layers,
and on the last stage sample the requests whose step reaches their last known token and build
the `StepOutput` (worker_svc.step_output; the scheduler does not send the last stage its own
tokens back).

Launch and finish are apart so that a GPU never waits for the host: `launch` queues the
step's work and returns; a greedy step's sampled ids stay on the device and the next step's
`launch` may take them from there (worker_svc.pending_tokens); `finish` waits for the step's
tokens and builds its `StepOutput`. Outputs still leave in step order. The step types
themselves live in worker_svc.launched_step, their timings in worker_svc.step_clock.

A step that raises leaves the runner consistent: the input batch forgets the step's requests
(see `InputBatch.discard`), nothing else persists between steps but the KV tensors, whose
slots for those requests are freed by the scheduler. `failed_output` is the answer to send.
"""

import gc
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from services.kv_chunks import KvSlice
from services.model_config import ModelConfig
from services.weights_fingerprint import weights_model_name
from services.wire import StepInput, StepOutput
from worker_svc.attention import AttentionMetadata, build_group_metadata
from worker_svc.cuda_graphs import DecodeGraphs, capture_sizes
from worker_svc.input_batch import InputBatch, ScheduledRequest, kernel_metadata
from worker_svc.kernels import CpuLevel
from worker_svc.kernels.kv_quant import is_fp8
from worker_svc.kernels.kv_quant import kv_cache_dtype as kv_cache_dtype_of
from worker_svc.kv_cache import (
    KvLayerSpec,
    allocate_kv_caches,
    bytes_per_block,
    layer_caches,
)
from worker_svc.kv_loader import KvLoader, not_sampling, settle_inline_loads, start_loads
from worker_svc.kv_saver import KvSaver, KvStoreOptions
from worker_svc.launched_step import LaunchedStep, StageActivations
from worker_svc.memory import return_freed_memory
from worker_svc.memory_budget import KvBudget, ShardFootprint, measure_kv_budget
from worker_svc.model.tensor_parallel import TpGroup
from worker_svc.model_loader import load_model
from worker_svc.pending_tokens import PendingTokens
from worker_svc.profile_step import profile_forward
from worker_svc.step_clock import StepTimer
from worker_svc.step_output import failed_output, sample_step, step_output

log = logging.getLogger(__name__)

class ModelRunner:
    """Runs steps for one pipeline stage (layers [first_layer, end_layer)) of one replica."""

    def __init__(self, model_config: ModelConfig, model_path: str | Path, dtype: torch.dtype,
                 worker_id: str, first_layer: int = 0, end_layer: int | None = None,
                 is_last_stage: bool = True, quant_kernels: bool = True,
                 tp: TpGroup | None = None, cpu_level: CpuLevel | None = None,
                 device: torch.device | None = None, kernels: str | None = None,
                 enforce_eager: bool = False, fail_request_prefix: str | None = None,
                 kv_store: KvStoreOptions | None = None, padded_decode: bool = False,
                 kv_cache_dtype: str = "auto", quantization: str = ""):
        """`quant_kernels`: run small CPU steps on the GGUF's own quantized blocks (see
        worker_svc.kernels.gemm); off = every matmul on dense weights. `tp`: this rank's
        tensor-parallel group (None: the whole width on this process). `cpu_level`: the C
        kernels' level (None: the best this CPU has). `device`: where it computes (default
        the CPU). `kernels`: auto / c / triton / torch (worker_svc.kernel_choice).
        `enforce_eager`: no CUDA graphs. `fail_request_prefix`: tests only, a step holding a
        request whose id starts with it raises before its forward. `kv_store`: kvcache_svc's
        KV store to save completed KV chunks to and load them from (None: neither).
        `padded_decode`: tests only, decode steps run through the padded persistent buffers
        without capturing graphs (how graph padding is tested on a CPU). `kv_cache_dtype`:
        --kv-cache-dtype (worker_svc.kernels.kv_quant); `quantization`: --quantization ("" or
        "int8")."""
        self.device = torch.device("cpu") if device is None else device
        self.config = model_config
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype_of(kv_cache_dtype, dtype)   # the cache's element type
        self.worker_id = worker_id
        self.is_last_stage = is_last_stage
        self.enforce_eager = enforce_eager
        self.model_path = model_path
        self._kv_model_name: str | None = None     # kv_slice's, computed once
        self.model, self.weight_bytes = load_model(
            model_config, model_path, dtype, self.device, first_layer, end_layer, is_last_stage,
            tp, cpu_level, kernels, quant_kernels, self.kv_dtype, quantization)
        self.kv_caches: list[torch.Tensor] = []      # per layer (shared within a position)
        self.input_batch: InputBatch | None = None
        self.graphs: DecodeGraphs | None = None
        self.padded_decode = padded_decode
        # The token ids the last step fed the model (first stage), for inspection in tests.
        self.last_input_ids: torch.Tensor | None = None
        self._pending_tokens = PendingTokens()      # greedy tokens still on the device
        self._timer = StepTimer(self.device)       # each step's timings, gaps between them
        # The current (or last) step's forward finished: its KV is all in the cache.
        self._kv_written = False
        # Test-only fault injection (SPLITSERVE_TEST_FAIL_REQUEST_PREFIX): a step holding a
        # request whose id starts with this raises before its forward.
        self.fail_request_prefix = fail_request_prefix
        # Saves completed KV chunks to the KV store (worker_svc.kv_saver), and loads them from
        # it (worker_svc.kv_loader); None: no store.
        self.kv_saver: KvSaver | None = None
        self.kv_loader: KvLoader | None = None
        if kv_store is not None:
            self.kv_saver = KvSaver(kv_store.address, self.kv_slice(), kv_store.max_queued_chunks,
                                    kv_store.codec)
            self.kv_loader = KvLoader(self.kv_saver, kv_store.codec)

    def kv_slice(self) -> KvSlice:
        """This rank's part of the model's KV: what its KV store chunks hold."""
        shard = self.model.shard
        # Named by the weights' fingerprint too: a model swapped under the same name never
        # matches KV its predecessor stored (issue 24).
        if self._kv_model_name is None:
            self._kv_model_name = weights_model_name(self.config.name, self.model_path)
            if is_fp8(self.kv_dtype):       # 8-bit chunks hold values / scale
                self._kv_model_name += f"+{self.model.kv_scales.describe()}"
        return KvSlice(self._kv_model_name, str(self.kv_dtype).removeprefix("torch."),
                       self.model.first_layer, self.model.end_layer, *shard.kv_heads)

    def rejoin(self, tp_group: "dist.ProcessGroup | None") -> None:
        """A kept shard placed again: the same tensor-parallel slice, over the new placement's
        process group (`ParallelGroups.tp_group`; ignored without tensor parallelism)."""
        if self.model.tp is not None:
            assert tp_group is not None
            self.model.tp.group = tp_group

    # -------------------------------------------------------------------------------- KV cache

    @property
    def kv_positions(self) -> tuple[int, ...]:
        """The KV group layout's tensor positions this stage's layers use, ascending (one per
        layer for a uniform model; services.kv_groups)."""
        return tuple(sorted(set(self.model.layer_positions)))

    def kv_layer_specs(self, block_size: int) -> list[KvLayerSpec]:
        """One spec per KV tensor this worker holds (`kv_positions`)."""
        cfg = self.config
        return [KvLayerSpec(block_size, self.model.shard.num_kv_heads, cfg.head_dim,
                            self.kv_dtype)
                for _ in self.kv_positions]

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block id costs this worker: a page in each of its KV tensors."""
        return bytes_per_block(self.kv_layer_specs(block_size))

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        """Blocks (null block included) that fit in `budget_bytes` for this worker's layers:
        the group layout's count for its tensor positions."""
        model = self.model
        page_bytes = self.kv_layer_specs(block_size)[0].page_bytes
        return model.kv_layout.num_blocks(budget_bytes, page_bytes,
                                          range(model.first_layer, model.end_layer))

    def describe_kv(self) -> str:
        """The KV group layout and this stage's share of it, for the sizing log."""
        model = self.model
        stored = str(self.kv_dtype).removeprefix("torch.")
        if is_fp8(self.kv_dtype) and model.kv_scales is not None:
            stored += f", scales {model.kv_scales.describe()}"
        return (f"{model.kv_layout.describe()}; layers [{model.first_layer}, "
                f"{model.end_layer}) use {len(self.kv_positions)} KV tensor(s) of {stored}")

    def footprint(self) -> ShardFootprint:
        """What this shard takes besides its KV cache: the memory budget's inputs."""
        cfg, shard = self.config, self.model.shard
        i0, i1 = shard.intermediate
        return ShardFootprint(self.device, self.weight_bytes, cfg.hidden_size,
                              (shard.num_heads + 2 * shard.num_kv_heads) * cfg.head_dim, i1 - i0,
                              cfg.vocab_size, self.dtype.itemsize, self.is_last_stage)

    def measure_kv_budget(self, block_size: int, max_num_batched_tokens: int,
                          max_num_seqs: int, cpu_cap_bytes: int | None,
                          gpu_memory_utilization: float = 0.9) -> KvBudget:
        """The KV budget from measured memory (worker_svc.memory_budget): on a GPU after a
        profiling forward of the largest step (worker_svc.profile_step); on a CPU from the
        host's available memory, capped at `cpu_cap_bytes`."""
        specs = self.kv_layer_specs(block_size)
        return measure_kv_budget(
            self.footprint(), max_num_batched_tokens, max_num_seqs, cpu_cap_bytes,
            gpu_memory_utilization, lambda num_tokens, num_rows: profile_forward(
                self.model, specs, num_tokens, num_rows, block_size, self.kv_positions))

    def release_cache(self) -> None:
        """Frees everything sized for the last placement: the KV tensors, the CUDA graphs and
        their persistent buffers, the input batch, the KV saver's idle staging buffers (loads
        still writing into the cache are waited for first). Then the memory is really free
        (CUDA: back from torch's cache; CPU: back to the kernel), so `measure_kv_budget` sees
        none of it: a worker placed again measures what the first placement measured."""
        if self.kv_loader is not None:
            self.kv_loader.wait_all()
        if self.kv_saver is not None:
            self.kv_saver.release_buffers()
        self.kv_caches, self.graphs, self.input_batch = [], None, None
        self._pending_tokens.clear()
        self._timer.reset()
        gc.collect()           # graphs and caches can sit in reference cycles (graph pools)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        else:
            return_freed_memory()

    def close(self) -> None:
        """`release_cache`, then stop the KV saver's and loader's threads (a runner replaced
        by another placement's)."""
        self.release_cache()
        if self.kv_saver is not None:
            self.kv_saver.close()
        if self.kv_loader is not None:
            self.kv_loader.close()
        self.kv_saver = self.kv_loader = None

    def init_cache(self, num_blocks: int, block_size: int, max_num_seqs: int = 256) -> None:
        """Allocate the KV tensors; drops any request state (block ids would be stale). On
        CUDA, captures the decode graphs (unless enforce_eager) for up to `max_num_seqs`."""
        if self.kv_caches or self.graphs is not None:
            self.release_cache()          # a second InitCache: the old cache goes first
        tensors = allocate_kv_caches(self.kv_layer_specs(block_size), num_blocks, self.device)
        self.kv_caches = layer_caches(tensors, self.kv_positions, self.model.layer_positions)
        self.input_batch = InputBatch(num_blocks, block_size, self.config.vocab_size,
                                      self.config.max_model_len,
                                      self.model.kv_layout.windows)
        self._pending_tokens.clear()
        self._timer.reset()
        # The graphs' metadata is the kernels' (block table, keys per row); the torch
        # attention path needs per-step padded gathers and is never captured.
        eligible = self.model.is_first_stage and self.model.kernels.attention is not None
        capture = (eligible and self.device.type == "cuda" and not self.enforce_eager
                   and self.model.tp is None)
        if capture or (eligible and self.padded_decode):
            from worker_svc.triton_kernels import TritonPagedAttention

            self.graphs = DecodeGraphs(
                self._graph_forward, capture_sizes(max_num_seqs),
                -(-self.config.max_model_len // block_size), block_size, self.device, capture,
                skip_padding=isinstance(self.model.kernels.attention, TritonPagedAttention),
                num_groups=self.model.kv_layout.num_groups)
            seconds = self.graphs.capture_all()
            if capture:
                log.info("captured CUDA graphs for decode batches %s in %.1fs",
                         self.graphs.sizes, seconds)

    def _graph_forward(self, input_ids: torch.Tensor, metas: list[AttentionMetadata]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward(input_ids, None, None, metas[0].positions, metas,
                                  self.kv_caches)

    # ------------------------------------------------------------------------------------ step

    def execute(self, step: StepInput, stage_input: StageActivations | None = None
                ) -> StepOutput | StageActivations:
        """Run one step and wait for its result (`launch`, then `finish`)."""
        return self.finish(self.launch(step, stage_input))

    def launch(self, step: StepInput, stage_input: StageActivations | None = None
               ) -> LaunchedStep:
        """Queue one step. `stage_input` is the previous stage's output (non-first stages
        only). If it raises, the step's requests are dropped from the input batch."""
        if self.input_batch is None:
            raise RuntimeError("launch() before init_cache()")
        if self.model.is_first_stage != (stage_input is None):
            raise ValueError("stage_input is required on, and only on, non-first stages")
        self._kv_written = False
        try:
            return self._launch(step, stage_input, self.input_batch)
        except Exception:
            self.input_batch.discard(step)
            raise

    def finish(self, launched: LaunchedStep) -> StepOutput | StageActivations:
        """Wait for a launched step and return its result; steps finish in launch order."""
        result: StepOutput | StageActivations | None = launched.activations
        if result is None:
            try:
                result = step_output(launched, self.worker_id, self._pending_tokens)
            except Exception:
                if self.input_batch is not None:
                    self.input_batch.discard(launched.step)
                if launched.saves and self.kv_saver is not None:
                    self.kv_saver.drop(launched.saves)
                raise
        if launched.saves and self.kv_saver is not None and self.input_batch is not None:
            self.kv_saver.submit(launched.saves, self.input_batch.block_size)
        return result

    def failed_output(self, step: StepInput, exc: Exception) -> StepOutput:
        """The answer to `step` after `launch` or `finish` raised `exc` (one-rank replicas)."""
        return failed_output(step, exc, self.worker_id, self._kv_written)

    def _launch(self, step: StepInput, stage_input: StageActivations | None,
                input_batch: InputBatch) -> LaunchedStep:
        start = time.perf_counter()
        if self.kv_loader is not None:   # their blocks may be reused from this step on
            self.kv_loader.wait_for(step.finished_ids)
        scheduled = input_batch.apply(step)
        launched = LaunchedStep(step, scheduled, loads=start_loads(   # before the forward
            self.kv_loader, step, input_batch, self.kv_caches, self.model.layer_groups))
        if self.kv_loader is not None:   # this step may read blocks a finished load wrote
            self.kv_loader.join_loads()
        if not scheduled:
            if not self.is_last_stage:
                empty = torch.empty(0, self.config.hidden_size, dtype=self.dtype,
                                    device=self.device)
                launched.activations = StageActivations(empty, empty)
            return launched
        prefix = self.fail_request_prefix
        if prefix is not None and any(s.state.request_id.startswith(prefix) for s in scheduled):
            raise RuntimeError(f"injected fault: a request id starts with {prefix!r}")
        # One-token queries first, then longer chunks by length (similar sizes share one
        # padded attention call on the torch path); output order is step order regardless.
        layout = sorted(scheduled, key=lambda s: (s.num_new_tokens != 1, -s.num_new_tokens))
        with torch.inference_mode():
            metas = self._attention_metadata(layout, input_batch)
            meta = metas[0]
            input_ids, hidden_in, residual_in = None, None, None
            if stage_input is None:
                input_ids = self._pending_tokens.input_ids(layout, self.device)
                self.last_input_ids = input_ids
            else:
                hidden_in, residual_in = stage_input.hidden_states, stage_input.residual
            prepared = time.perf_counter()
            launched.gpu = self._timer.forward_starts(launched.clock, start, prepared)
            loads = launched.loads
            inline = loads if loads is not None and loads.inline_ids else None
            if (self.graphs is not None and input_ids is not None and inline is None
                    and meta.num_decodes == len(layout) and self.graphs.fits(len(layout))):
                hidden, residual = self.graphs.run(input_ids, metas)
            else:       # a layer-wise load's layers are waited for one by one
                hidden, residual = self.model.forward(
                    input_ids, hidden_in, residual_in, meta.positions, metas, self.kv_caches,
                    None if inline is None else inline.wait_layer)
            self._kv_written = True
            short: set[str] = set()
            if inline is not None:
                short = settle_inline_loads(inline, scheduled, self.model.tp, self.device)
                layout, scheduled = not_sampling(layout, short), not_sampling(scheduled, short)
                launched.scheduled = scheduled
            forwarded = time.perf_counter()
            launched.clock.num_tokens = int(meta.positions.shape[0])
            if not self.is_last_stage:
                launched.activations = StageActivations(hidden, residual)
            else:
                sample_step(self.model, launched, layout, hidden, residual,
                            self._pending_tokens, self.device)
            if self.kv_saver is not None:     # last to raise: copied before any later step
                launched.saves = self.kv_saver.copy_out(
                    [s for s in scheduled if s.state.request_id not in short], self.kv_caches,
                                                        input_batch.block_size,
                                                        self.model.layer_groups)
            self._timer.launched(launched.clock, launched.gpu, start, prepared, forwarded)
        return launched

    def _attention_metadata(self, layout: list[ScheduledRequest], input_batch: InputBatch
                            ) -> list[AttentionMetadata]:
        """One metadata per KV group, on the device: the groups' block tables, hence their
        slots and tables, differ; positions and lengths are the same. The kernels' from the
        batch's persistent block tables (numpy); the torch path's from its lists."""
        if self.model.kernels.attention is not None:
            return kernel_metadata(layout, input_batch, self.device)
        return build_group_metadata(
            [s.num_new_tokens for s in layout], [s.num_computed_tokens for s in layout],
            [[s.state.block_ids[group] for s in layout]
             for group in range(self.model.kv_layout.num_groups)],
            input_batch.block_size, input_batch.num_blocks, self.device, torch_path=True)

