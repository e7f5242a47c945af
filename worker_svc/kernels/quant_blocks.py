"""The quantized block format of a GGUF's Q4_0, Q4_1 and Q8_0 matrices: what the weights loader
(worker_svc.model.weights) reads from the file, tensor parallelism
(worker_svc.model.tensor_parallel) cuts into slices, and the small-step matmul kernels
(worker_svc.kernels.gemm) multiply. A leaf of the kernels package: it imports nothing of the
worker's.
"""

from dataclasses import dataclass

import torch

QUANT_BLOCK = 32  # weights per scale/offset pair along the input dimension (ggml's block)


@dataclass(frozen=True, slots=True)
class QuantBlocks:
    """A matrix as quantized values in blocks of 32 along the input dimension, as the GGUF
    stores it: weight[o, i] = scales[o, i // 32] * values[o, i] + offsets[o, i // 32]
    (computed in float32, this is gguf's own dequantization)."""

    values: torch.Tensor     # [out_features, in_features]: bits 4 uint8 in 0..15, 8 int8
    scales: torch.Tensor     # [out_features, in_features // 32] float32
    offsets: torch.Tensor    # [out_features, in_features // 32] float32 (zero for Q8_0)
    bits: int                # 4 (Q4_0, Q4_1) or 8 (Q8_0)
