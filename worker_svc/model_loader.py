"""Builds the model a runner serves: the dtype checked against the device, the layers' kernels
chosen (worker_svc.kernel_choice, the one place that decides), the model built for its
pipeline stage and tensor-parallel slice (worker_svc.model) and its weights loaded onto the
device. Called once by `ModelRunner.__init__` (worker_svc.runner); the runner then owns the
model for its whole life.
"""

from pathlib import Path

import torch

from services.model_config import ModelConfig
from worker_svc.device import dtype_for
from worker_svc.kernel_choice import choose_kernels
from worker_svc.kernels import CpuLevel, with_int8
from worker_svc.kernels.kv_quant import KvScales
from worker_svc.model.llama import LlamaModel
from worker_svc.model.tensor_parallel import TpGroup, TpShard
from worker_svc.model.weights import load_weights

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def load_model(config: ModelConfig, model_path: str | Path, dtype: torch.dtype,
               device: torch.device, first_layer: int, end_layer: int | None,
               is_last_stage: bool, tp: TpGroup | None, cpu_level: CpuLevel | None,
               kernels: str | None, quant_kernels: bool, kv_dtype: torch.dtype | None = None,
               quantization: str = "") -> tuple[LlamaModel, int]:
    """Layers [first_layer, end_layer) of the model at `model_path` (`tp`: this rank's slice;
    None: the whole width), computing in `dtype` on `device`, with their weights loaded; and
    the bytes those weights take. `cpu_level`, `kernels`, `quant_kernels`: as
    `ModelRunner`'s; `kv_dtype`: the KV cache's element type (None: `dtype`; 8-bit with
    worker_svc.kernels.kv_quant's scales); `quantization`: "" or "int8" (the decoder layers'
    matmul weights quantized at load, worker_svc.kernels.gemm_int8; the bytes counted as
    int8). ValueError for a dtype the device cannot compute in, or for int8 where the
    kernels' level has no int8 matmul."""
    if device.type == "cuda":
        # float32 means float32 (the oracle's precision): no TF32 in matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, not {dtype}")
    dtype_for(device, name)      # refuses what this device cannot compute in
    if quantization not in ("", "int8"):
        raise ValueError(f"quantization must be int8 or none, not {quantization!r}")
    shard = tp.shard if tp is not None else TpShard.whole(
        config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size)
    kv_scales = KvScales()
    layer_kernels = choose_kernels(device, cpu_level, config.head_dim,
                                   shard.num_heads // shard.num_kv_heads, dtype, kernels,
                                   kv_dtype, kv_scales)
    if quantization == "int8":
        layer_kernels = with_int8(layer_kernels)   # the model reads it from its kernel set
    model = LlamaModel(config, dtype, first_layer, end_layer, is_last_stage, tp, device,
                       kernels=layer_kernels, kv_scales=kv_scales)
    weights = load_weights(model_path, config, dtype, first_layer, model.end_layer,
                           is_last_stage)
    if not quant_kernels or not layer_kernels.quant:
        weights.quant.clear()            # only the CPU's quantized-block kernels use them
    if device.type != "cpu":
        weights.tensors = {k: t.to(device) for k, t in weights.tensors.items()}
    model.load_weights(weights)
    int8 = layer_kernels.int8 is not None
    return model, sum(_loaded_bytes(name, t, int8) for name, t in weights.tensors.items())


def _loaded_bytes(name: str, tensor: torch.Tensor, int8: bool) -> int:
    """What one weight takes once loaded: with int8, a decoder layer's matmul weight is one
    byte a value plus a float32 scale per output row (worker_svc.model.linear.Linear keeps
    no dense copy of it)."""
    if int8 and name.startswith("model.layers.") and name.endswith("_proj.weight"):
        return tensor.numel() + 4 * tensor.shape[0]
    return tensor.numel() * tensor.element_size()
