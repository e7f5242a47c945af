"""`ModelRunner`: one worker's model shard, its KV cache and input batch; runs one step.

The worker's service loop owns the sockets and calls, in order: `kv_bytes_per_block` /
`num_blocks_for_budget` (capacity report), `init_cache` (after `InitCache`), then `execute`
once per `StepInput`. The last pipeline stage returns a `StepOutput`; an earlier stage
returns the `StageActivations` its caller sends to the next stage, whose `execute` takes them.

A step: apply the diff to the input batch, lay the requests out one-token queries first,
build every per-step tensor once, run the stage's layers, and on the last stage compute logits
only for requests whose step reaches their last known token, sample, and append each sampled
token to its request (the scheduler does not send the last stage its own tokens back).

A step that raises leaves the runner consistent: the input batch forgets the step's requests
(see `InputBatch.discard`), nothing else persists between steps but the KV tensors, whose
slots for those requests are freed by the scheduler. `failed_output` is the answer to send.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.model_config import ModelConfig
from services.wire import (
    IDLE_GAP_S,
    StepError,
    StepInput,
    StepOutput,
    StepTimings,
    TokenLogprobs,
)
from worker_svc.attention import build_attention_metadata
from worker_svc.input_batch import InputBatch, ScheduledRequest
from worker_svc.kernels import CpuLevel
from worker_svc.kv_cache import (
    KvLayerSpec,
    allocate_kv_caches,
    bytes_per_block,
    num_blocks_for_budget,
)
from worker_svc.model.llama import LlamaModel
from worker_svc.model.weights import load_weights
from worker_svc.sampler import sample
from worker_svc.tensor_parallel import TpGroup


@dataclass(slots=True)
class StageActivations:
    """What a non-last pipeline stage hands to the next one, rows in the step's layout."""

    hidden_states: torch.Tensor   # [num_tokens, hidden_size]
    residual: torch.Tensor        # [num_tokens, hidden_size]


class ModelRunner:
    """Runs steps for one pipeline stage (layers [first_layer, end_layer)) of one replica."""

    def __init__(self, model_config: ModelConfig, model_path: str | Path, dtype: torch.dtype,
                 worker_id: str, first_layer: int = 0, end_layer: int | None = None,
                 is_last_stage: bool = True, quant_kernels: bool = True,
                 tp: TpGroup | None = None, cpu_level: CpuLevel | None = None):
        """`quant_kernels`: run small steps on the GGUF's own quantized blocks (see
        worker_svc.kernels.gemm); off = every matmul on dense weights. `tp`: this rank's
        tensor-parallel group (None: the whole width on this process). `cpu_level`: the C
        kernels' level (None: the best this CPU has)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, not {dtype}")
        self.config = model_config
        self.dtype = dtype
        self.worker_id = worker_id
        self.is_last_stage = is_last_stage
        self.model = LlamaModel(model_config, dtype, first_layer, end_layer, is_last_stage, tp,
                                cpu_level)
        weights = load_weights(model_path, model_config, dtype, first_layer,
                               self.model.end_layer, is_last_stage)
        if not quant_kernels:
            weights.quant.clear()
        self.model.load_weights(weights)
        self.kv_caches: list[torch.Tensor] = []
        self.input_batch: InputBatch | None = None
        # The token ids the last step fed the model (first stage), for inspection in tests.
        self.last_input_ids: torch.Tensor | None = None
        self._last_forward_end: float | None = None   # perf_counter() after the last forward
        # The current (or last) step's forward finished: its KV is all in the cache.
        self._kv_written = False
        # Test-only fault injection (worker_svc.server, from the environment): a step holding
        # a request whose id starts with this raises before its forward.
        self.fail_request_prefix: str | None = None

    # -------------------------------------------------------------------------------- KV cache

    def kv_layer_specs(self, block_size: int) -> list[KvLayerSpec]:
        cfg = self.config
        return [KvLayerSpec(block_size, self.model.shard.num_kv_heads, cfg.head_dim, self.dtype)
                for _ in self.model.layers]

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block costs across this worker's layers."""
        return bytes_per_block(self.kv_layer_specs(block_size))

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        """Blocks (null block included) that fit in `budget_bytes` for this worker's layers."""
        return num_blocks_for_budget(budget_bytes, self.kv_layer_specs(block_size))

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV tensors; drops any request state (block ids would be stale)."""
        self.kv_caches = allocate_kv_caches(self.kv_layer_specs(block_size), num_blocks)
        self.input_batch = InputBatch(num_blocks, block_size, self.config.vocab_size,
                                      self.config.max_model_len)

    # ------------------------------------------------------------------------------------ step

    def execute(self, step: StepInput, stage_input: StageActivations | None = None
                ) -> StepOutput | StageActivations:
        """Run one step. `stage_input` is the previous stage's output (non-first stages only).

        Returns the `StepOutput` on the last stage, else this stage's `StageActivations`. If
        the step raises, its requests are dropped from the input batch before it propagates.
        """
        if self.input_batch is None:
            raise RuntimeError("execute() before init_cache()")
        if self.model.is_first_stage != (stage_input is None):
            raise ValueError("stage_input is required on, and only on, non-first stages")
        self._kv_written = False
        try:
            return self._execute(step, stage_input, self.input_batch)
        except Exception:
            self.input_batch.discard(step)
            raise

    def failed_output(self, step: StepInput, exc: Exception) -> StepOutput:
        """The answer to `step` after `execute` raised `exc` (one-rank replicas only)."""
        return StepOutput(step_id=step.step_id, worker_id=self.worker_id, request_ids=[],
                          sampled_token_ids=[], logprobs=[],
                          timings=StepTimings(prepare_ms=0.0, forward_ms=0.0, sample_ms=0.0,
                                              num_tokens=0),
                          error=StepError(f"{type(exc).__name__}: {exc}"[:4096],
                                          kv_written=self._kv_written))

    def _execute(self, step: StepInput, stage_input: StageActivations | None,
                 input_batch: InputBatch) -> StepOutput | StageActivations:
        start = time.perf_counter()
        scheduled = input_batch.apply(step)
        if not scheduled:
            return self._empty_result(step)
        prefix = self.fail_request_prefix
        if prefix is not None and any(s.state.request_id.startswith(prefix) for s in scheduled):
            raise RuntimeError(f"injected fault: a request id starts with {prefix!r}")
        # One-token queries first, then longer chunks by length (similar sizes share one
        # padded attention call); output order is step order regardless.
        layout = sorted(scheduled, key=lambda s: (s.num_new_tokens != 1, -s.num_new_tokens))
        with torch.inference_mode():
            meta = build_attention_metadata(
                [s.num_new_tokens for s in layout], [s.num_computed_tokens for s in layout],
                [s.state.block_ids for s in layout], input_batch.block_size,
                input_batch.num_blocks,
                torch_path=self.model.kernels.attention is None)
            input_ids, hidden_in, residual_in = None, None, None
            if stage_input is None:
                input_ids = torch.tensor(
                    [t for s in layout for t in
                     s.state.token_ids[s.num_computed_tokens:
                                       s.num_computed_tokens + s.num_new_tokens]],
                    dtype=torch.int64)
                self.last_input_ids = input_ids
            else:
                hidden_in, residual_in = stage_input.hidden_states, stage_input.residual
            prepared = time.perf_counter()
            gap = 0.0
            if self._last_forward_end is not None and start - self._last_forward_end < IDLE_GAP_S:
                gap = prepared - self._last_forward_end
            hidden, residual = self.model.forward(input_ids, hidden_in, residual_in,
                                                  meta.positions, meta, self.kv_caches)
            forwarded = time.perf_counter()
            self._kv_written = True
            if not self.is_last_stage:
                self._last_forward_end = forwarded
                return StageActivations(hidden, residual)
            request_ids, token_ids, logprobs = self._sample(layout, scheduled, hidden, residual)
        done = self._last_forward_end = time.perf_counter()
        return StepOutput(
            step_id=step.step_id, worker_id=self.worker_id, request_ids=request_ids,
            sampled_token_ids=token_ids, logprobs=logprobs,
            timings=StepTimings(prepare_ms=(prepared - start) * 1e3,
                                forward_ms=(forwarded - prepared) * 1e3,
                                sample_ms=(done - forwarded) * 1e3,
                                num_tokens=len(meta.positions), gap_ms=gap * 1e3))

    def _empty_result(self, step: StepInput) -> StepOutput | StageActivations:
        """A step that only drops finished requests."""
        if not self.is_last_stage:
            empty = torch.empty(0, self.config.hidden_size, dtype=self.dtype)
            return StageActivations(empty, empty)
        return StepOutput(step_id=step.step_id, worker_id=self.worker_id, request_ids=[],
                          sampled_token_ids=[], logprobs=[],
                          timings=StepTimings(prepare_ms=0.0, forward_ms=0.0, sample_ms=0.0,
                                              num_tokens=0))

    def _sample(self, layout: list[ScheduledRequest], scheduled: list[ScheduledRequest],
                hidden: torch.Tensor, residual: torch.Tensor
                ) -> tuple[list[str], list[int], list[TokenLogprobs | None]]:
        """Sample the requests whose step ends at their last known token; report in step order."""
        rows, sampling = [], []
        end = 0
        for s in layout:
            end += s.num_new_tokens
            if s.samples:
                rows.append(end - 1)      # the request's last row in the flat batch
                sampling.append(s)
        if not sampling:
            return [], [], []
        index = torch.tensor(rows)
        logits = self.model.compute_logits(hidden.index_select(0, index),
                                           residual.index_select(0, index))  # [rows, vocab]
        token_ids, logprobs = sample(logits, [s.state.sampling for s in sampling],
                                     [s.state.generator for s in sampling],
                                     argmax=self.model.elementwise.argmax)
        by_request: dict[str, tuple[int, TokenLogprobs | None]] = {}
        for s, token_id, lp in zip(sampling, token_ids, logprobs, strict=True):
            s.state.token_ids.append(token_id)
            by_request[s.state.request_id] = (token_id, lp)
        ordered = [s.state.request_id for s in scheduled if s.samples]
        return (ordered, [by_request[r][0] for r in ordered], [by_request[r][1] for r in ordered])
