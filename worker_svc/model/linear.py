"""A decoder's matmuls on the CPU paths we have: `Linear` (y = x @ weight.T, the fastest
kernel for the weight and the step's size) and `linear_from`, which cuts the named matrices
to a tensor-parallel rank's slice and stacks them into one `Linear` (q/k/v, gate/up).
Used by worker_svc.model.llama for every layer's projections and the LM head.
"""

import sys

import torch
import torch.nn.functional as F

from worker_svc.kernels import (
    AmxGemm,
    CpuLevel,
    Gemm,
    Int8Gemm,
    LayerKernels,
    PackedInt8,
    PackedQuant,
    PackedWeight,
    QuantBlocks,
    QuantKernel,
    TieredPack,
    TieredQuant,
)
from worker_svc.model.tensor_parallel import (
    slice_cols,
    slice_quant_cols,
    slice_quant_rows,
    slice_rows,
)
from worker_svc.model.weights import ModelWeights


class Linear:
    """y = x @ weight.T, with the fastest CPU path we have for the weight and batch size.

    With `int8` (`--quantization int8`: the decoder layers' matmuls) and an int8 kernel in
    `kernels.int8`, the weight is quantized once here (int8, a scale per output column) and
    every step takes that kernel; no dense copy and no blocks are kept (a weight it does not
    take, k past its int32 bound, stays dense). Not even for small steps, though a GGUF's
    4-bit blocks read fewer bytes (single-stream decode 5.64 against int8's 5.89 ms a step,
    SmolLM2 bf16, 2 Zen 5 cores): the blocks hold other values than the int8 weights, so a
    request's tokens would depend on the sizes of the steps it ran in (a prefix hit's short
    step gave other greedy tokens than the full prefill, measured).

    Otherwise, in order: a weight with quantized blocks takes its kernel on those
    (`kernels.quant`) for steps of up to that kernel's `max_rows` rows (every step where it
    has none: then no dense copy is kept); then our own matmul kernel (`kernels.gemm`, with its
    own packed copy) for the batch sizes it takes; then, for bfloat16 where oneDNN runs it,
    oneDNN on a weight pre-packed once into its blocked layout (a plain bf16 matmul re-packs
    the weight on every call: 20-25% slower at 64-128 rows, measured); else torch's matmul on
    the plain weight.
    """

    __slots__ = ("weight", "onednn", "quant", "quant_weight", "quant_max_rows", "gemm",
                 "gemm_weight", "gemm_max_rows", "int8", "int8_weight")

    def __init__(self, parts: list[torch.Tensor], quant_parts: list[QuantBlocks] | None = None,
                 kernels: LayerKernels | None = None, int8: bool = False):
        kernels = kernels or LayerKernels(CpuLevel.NONE)
        self.int8: Int8Gemm | None = None
        self.int8_weight: PackedInt8 | None = None
        self.quant: QuantKernel | TieredQuant | None = None
        self.quant_weight: PackedQuant | TieredPack | None = None
        self.quant_max_rows = 0
        self.gemm: Gemm | AmxGemm | None = None
        self.gemm_weight: PackedWeight | None = None
        self.gemm_max_rows = -1
        self.weight: torch.Tensor | None = None             # plain, for torch's matmul
        self.onednn: torch.Tensor | None = None             # oneDNN layout, bfloat16 only
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)  # [out, in]
        if int8 and kernels.int8 is not None and kernels.int8.fits(weight):
            self.int8, self.int8_weight = kernels.int8, kernels.int8.pack(weight)
            return                                          # every step, in int8
        blocks = _concat_blocks(quant_parts) if quant_parts else None
        quant = kernels.quant.get(blocks.bits) if blocks is not None else None
        if isinstance(quant, TieredQuant) and not quant.large.fits(blocks):
            quant = quant.small                 # a shape the tiles do not take: small steps
        if quant is not None and quant.fits(blocks):
            self.quant, self.quant_weight = quant, quant.pack(blocks)
            self.quant_max_rows = quant.max_rows or sys.maxsize
        if self.quant_max_rows == sys.maxsize:
            return                                          # the blocks take every step
        if kernels.gemm is not None and kernels.gemm.fits(weight):
            self.gemm, self.gemm_weight = kernels.gemm, kernels.gemm.pack(weight)
            self.gemm_max_rows = kernels.gemm.max_rows or sys.maxsize
        if self.gemm_max_rows < sys.maxsize:                # rows the kernel leaves over
            if weight.dtype == torch.bfloat16 and kernels.onednn_bf16:
                # The batch-size hint only tunes the layout; any batch size works.
                self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
            else:
                self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in] contiguous -> [num_tokens, out]."""
        if self.int8 is not None:
            return self.int8(x, self.int8_weight)  # type: ignore[arg-type]
        num_tokens = x.shape[0]
        if num_tokens <= self.quant_max_rows:
            return self.quant(x, self.quant_weight)  # type: ignore[misc, arg-type]
        if num_tokens <= self.gemm_max_rows:
            return self.gemm(x, self.gemm_weight)  # type: ignore[misc]
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, None, "none", [], "")
        return F.linear(x, self.weight)


def _concat_blocks(parts: list[QuantBlocks]) -> QuantBlocks | None:
    """Blocks of matrices stacked by rows (q/k/v, gate/up); None if their kinds differ."""
    if len({b.bits for b in parts}) != 1:
        return None
    if len(parts) == 1:
        return parts[0]
    return QuantBlocks(torch.cat([b.values for b in parts]), torch.cat([b.scales for b in parts]),
                       torch.cat([b.offsets for b in parts]), parts[0].bits)


def linear_from(weights: ModelWeights, parts: list[tuple[str, str, int, int]],
            kernels: LayerKernels) -> Linear:
    """One matmul over the named matrices stacked by rows, each cut to this rank's slice:
    (name, "rows" | "cols", start, end). The blocks are used only if every part has blocks
    that the cut keeps whole. int8 (where `kernels.int8` is set) only for the decoder layers'
    matmuls: the LM head stays dense, its error would land straight on the logits."""
    dense, quant = [], []
    for name, axis, start, end in parts:
        weight = weights.tensors[name]
        blocks = weights.quant.get(name)
        if axis == "rows":
            whole = (start, end) == (0, weight.shape[0])
            dense.append(weight if whole else slice_rows(weight, start, end))
            cut = blocks if blocks is None or whole else slice_quant_rows(blocks, start, end)
        else:
            whole = (start, end) == (0, weight.shape[1])
            dense.append(weight if whole else slice_cols(weight, start, end))
            cut = blocks if blocks is None or whole else slice_quant_cols(blocks, start, end)
        quant.append(cut)
    kept = [b for b in quant if b is not None]
    in_layer = all(name.startswith("model.layers.") for name, *_ in parts)
    return Linear(dense, kept if len(kept) == len(parts) else None, kernels, int8=in_layer)
