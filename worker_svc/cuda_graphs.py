"""CUDA graphs for decode-only steps: persistent input buffers, padding, capture and replay.

A small model's decode step launches a few hundred kernels that each run for microseconds, so
launching them one by one from Python costs more than the GPU's work (8-14 ms against ~1 ms
for SmolLM2). A CUDA graph replays the whole forward with one launch. A graph's tensors are
fixed, so:

- the step's inputs (token ids, positions, KV slots, block table, keys per row) are copied
  into persistent buffers, allocated once at the largest batch, that the graph reads: this is
  also the worker's persistent batch on the GPU (nothing is re-allocated per step);
- a graph exists per captured batch size (`capture_sizes`), and a step of n requests runs the
  graph of the next size up (`padded_size`); the padding rows do what the Triton kernels' docs
  say of them: slot -1 (`write_kv` skips the row: the cache is never touched) and no keys
  (kv_len 0: `paged_attention` outputs zeros and reads nothing), and their outputs are
  dropped. The C kernels (the CPU test path, `skip_padding=False`) take neither, so there a
  padding row writes slot 0 of the null block 0 and attends that one key (real rows never
  read block 0: it is only ever padding in their block tables);
- a model with several KV groups (services.kv_groups) has a slot mapping and a block table
  buffer per group (each group's blocks differ), and the graph's forward takes one metadata
  per group over them;
- steps with a prefill chunk, and decode batches above the largest size, run eagerly;
- every graph is captured on one stream, made once, which also runs the warm-up passes: each
  new stream would get its own cuBLAS workspace, memory taken after the KV cache was sized.

`DecodeGraphs(capture=False)` runs the same padded buffers eagerly: that is `--enforce-eager`'s
decode path on a GPU and how the padding logic is tested on a CPU. Outputs are identical with
and without graphs: the same kernels run on the same padded inputs.

Graphs are used by a worker that holds the whole model on one GPU or is the first pipeline
stage without tensor parallelism; other ranks run eagerly (collectives inside a captured graph
need NCCL's graph-safe setup, not done yet).
"""

import logging
import time
from collections.abc import Callable

import torch

from worker_svc.attention import AttentionMetadata

log = logging.getLogger(__name__)

# Batch sizes captured, up to the scheduler's max_num_seqs: every size to 4, then steps that
# keep padding under a quarter of the batch.
_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# (input ids, one metadata per KV group) -> (hidden, residual)
Forward = Callable[[torch.Tensor, list[AttentionMetadata]], tuple[torch.Tensor, torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture for a scheduler that runs at most `max_num_seqs` requests:
    the listed sizes below it, and `max_num_seqs` itself if it is not a listed size (up to
    512; larger decode batches run eagerly)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    cap = min(max_num_seqs, _SIZES[-1])
    sizes = [s for s in _SIZES if s < cap]
    return sizes + [cap]


def padded_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_rows` rows, or None (run eagerly)."""
    for size in sizes:
        if size >= num_rows:
            return size
    return None


class DecodeGraphs:
    """Decode steps through persistent buffers, replayed from CUDA graphs (or run eagerly on
    the same padded buffers with `capture=False`)."""

    def __init__(self, forward: Forward, sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, device: torch.device, capture: bool,
                 skip_padding: bool = True, num_groups: int = 1):
        """`forward(input_ids, metas) -> (hidden, residual)`: the model stage's forward over
        the layers and this worker's KV caches, one metadata per KV group. `max_blocks_per_seq`:
        the widest block table a request can have (max_model_len / block_size, rounded up).
        `skip_padding`: the kernels skip slot -1 and take kv_len 0 (Triton); False: padding
        rows use the null block's slot 0 and one key (the C kernels). `num_groups`: the
        model's KV groups."""
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.forward = forward
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.device = device
        self.capture = capture
        # What a padding row holds: (slot, kv_len).
        self.padding = (-1, 0) if skip_padding else (0, 1)
        n = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        # Persistent inputs; padding rows as `self.padding` says, block table row of zeros.
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.row_request = torch.arange(n, **i64)        # decode: row i is request i
        self.kv_lens = torch.full((n,), self.padding[1], **i64)
        # Per KV group: where each row's K/V goes, and the rows' block tables.
        self.slot_mappings = [torch.full((n,), self.padding[0], **i64)
                              for _ in range(num_groups)]
        self.block_tables = [torch.zeros(n, max_blocks_per_seq, **i64)
                             for _ in range(num_groups)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.stream: torch.cuda.Stream | None = None      # warm-up and capture, made once

    def fits(self, num_rows: int) -> bool:
        return padded_size(num_rows, self.sizes) is not None

    def _meta(self, size: int) -> list[AttentionMetadata]:
        """Per KV group, metadata over the first `size` rows of the persistent buffers
        (kernel path)."""
        empty = self.positions[:0]
        return [AttentionMetadata(
            self.block_size, self.positions[:size], slots[:size], size, empty,
            torch.empty(0, 1, 0, device=self.device),
            torch.empty(0, 1, 1, 0, dtype=torch.bool, device=self.device),
            table[:size], self.row_request[:size], self.kv_lens[:size], [])
            for slots, table in zip(self.slot_mappings, self.block_tables, strict=True)]

    def _fill(self, input_ids: torch.Tensor, metas: list[AttentionMetadata], size: int) -> None:
        """Copy a step's n rows in and reset rows n..size to padding."""
        n = input_ids.shape[0]
        for meta, table in zip(metas, self.block_tables, strict=True):
            width = meta.block_table.shape[1]
            if width > table.shape[1]:
                raise ValueError(f"block table of {width} blocks exceeds the "
                                 f"{table.shape[1]} a request can have")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(metas[0].positions, non_blocking=True)
        self.kv_lens[:n].copy_(metas[0].row_kv_lens, non_blocking=True)
        for meta, slots, table in zip(metas, self.slot_mappings, self.block_tables,
                                      strict=True):
            slots[:n].copy_(meta.slot_mapping, non_blocking=True)
            table[:n, :meta.block_table.shape[1]].copy_(meta.block_table, non_blocking=True)
        if size > n:
            for buf in (self.input_ids, self.positions):
                buf[n:size].zero_()
            self.kv_lens[n:size].fill_(self.padding[1])
            for slots, table in zip(self.slot_mappings, self.block_tables, strict=True):
                slots[n:size].fill_(self.padding[0])
                table[n:size].zero_()

    def run(self, input_ids: torch.Tensor, metas: list[AttentionMetadata]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step (one metadata per KV group, num_decodes == rows, one row per
        request, in table order) -> (hidden, residual) of its rows."""
        n = input_ids.shape[0]
        if len(metas) != len(self.block_tables):
            raise ValueError(f"{len(metas)} metadata for {len(self.block_tables)} KV groups")
        if metas[0].num_decodes != n or metas[0].row_request.shape[0] != n:
            raise ValueError("DecodeGraphs runs decode-only steps")
        size = padded_size(n, self.sizes)
        if size is None:
            raise ValueError(f"{n} rows exceed the largest captured size {self.sizes[-1]}")
        self._fill(input_ids, metas, size)
        if size in self.graphs:
            graph, hidden, residual = self.graphs[size]
            graph.replay()
        else:
            hidden, residual = self.forward(self.input_ids[:size], self._meta(size))
        return hidden[:n], residual[:n]

    def capture_all(self) -> float:
        """Capture a graph per size, largest first so that smaller ones reuse its memory pool,
        all on one stream. Returns the seconds taken. Needs the KV caches allocated (with
        the C kernels' padding the forward writes the null block's slot 0, harmless)."""
        if not self.capture:
            return 0.0
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stream, current = self.stream, torch.cuda.current_stream(self.device)
        for size in sorted(self.sizes, reverse=True):
            self._fill(self.input_ids[:0], self._meta(0), size)
            meta = self._meta(size)
            # Warm up on the capture stream (Triton compiles, cuBLAS picks its kernels and
            # sizes its workspace for this stream) before capture, as torch's graph
            # documentation asks.
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward(self.input_ids[:size], meta)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                hidden, residual = self.forward(self.input_ids[:size], meta)
            self.graphs[size] = (graph, hidden, residual)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started
