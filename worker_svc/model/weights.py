"""Weight loading: a GGUF file or a Hugging Face directory into HF-named tensors of one shard.

`load_weights` returns `ModelWeights`: dense tensors keyed by Hugging Face Llama parameter names
(`model.layers.3.self_attn.q_proj.weight`, ...), restricted to what a pipeline stage with layers
[first_layer, end_layer) needs, in the requested dtype; and, for GGUF tensors stored as Q4_0,
Q4_1 or Q8_0, their quantized values with per-32 scales and offsets (`QuantBlocks`), which the
model multiplies directly for small steps. `LlamaModel.load_weights` consumes both.

GGUF files written by llama.cpp's converter store attn_q / attn_k (weights and biases) of the
`llama` architecture with the rows of every head permuted for llama.cpp's interleaved RoPE; we
undo that here so both sources give HF's layout. `qwen2` / `qwen3` use llama.cpp's NEOX RoPE
(HF's own pairing) and are stored unpermuted.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from services.gguf_file import GgufError, GgufFile
from services.model_config import ModelConfig, ModelFormatError
from worker_svc.kernels.quant_blocks import QUANT_BLOCK, QuantBlocks

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Read into ModelConfig (services/gguf_config.py), not weights.
_GGUF_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(slots=True)
class ModelWeights:
    """One stage's weights, HF-named."""

    tensors: dict[str, torch.Tensor]                              # dense, in the load dtype
    quant: dict[str, QuantBlocks] = field(default_factory=dict)  # Q4_0/Q4_1/Q8_0 GGUF matrices


def load_weights(path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 first_layer: int = 0, end_layer: int | None = None,
                 is_last_stage: bool = True) -> ModelWeights:
    """Weights of layers [first_layer, end_layer) plus the stage's embedding/head."""
    end = config.num_layers if end_layer is None else end_layer
    wanted = _wanted_filter(config, first_layer, end, is_last_stage)
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        weights = _load_gguf(path, config, wanted)
    elif path.is_dir() and (path / "config.json").is_file():
        weights = ModelWeights(_load_hf_dir(path, wanted))
    else:
        raise ModelFormatError(f"{path}: expected a .gguf file or a directory with config.json")
    weights.tensors = {name: t.to(dtype) for name, t in weights.tensors.items()}
    return weights


def _wanted_filter(config: ModelConfig, first_layer: int, end_layer: int,
                   is_last_stage: bool) -> Callable[[str], bool]:
    if not 0 <= first_layer < end_layer <= config.num_layers:
        raise ValueError(f"layer range [{first_layer}, {end_layer}) is not inside "
                         f"[0, {config.num_layers})")
    # The head of a tied model is the embedding, so the last stage needs it too.
    needs_embedding = first_layer == 0 or (is_last_stage and config.tie_word_embeddings)

    def wanted(hf_name: str) -> bool:
        if hf_name.startswith("model.layers."):
            layer = int(hf_name.split(".")[2])
            return first_layer <= layer < end_layer
        if hf_name == "model.embed_tokens.weight":
            return needs_embedding
        if hf_name in ("model.norm.weight", "lm_head.weight"):
            return is_last_stage
        return False

    return wanted


# ------------------------------------------------------------------------------------------ GGUF


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)  # "blk", "N", "attn_q.weight"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_llama_cpp_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of attn_q / attn_k (any per-row tensor).

    Per head, llama.cpp reorders output rows [r_0 .. r_{d/2-1}, r_{d/2} .. r_{d-1}] into pairs
    (r_0, r_{d/2}, r_1, r_{d/2+1}, ...) so that RoPE rotates adjacent elements. Viewing each
    head's rows as [2, d/2] (HF) vs [d/2, 2] (GGUF), the inverse is a transpose of those axes.
    """
    num_rows, *rest = weight.shape  # [num_heads * head_dim, ...]
    head_dim = num_rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *rest)
            .transpose(1, 2)
            .reshape(weight.shape))


def _load_gguf(path: Path, config: ModelConfig, wanted: Callable[[str], bool]) -> ModelWeights:
    from gguf.quants import dequantize

    try:
        reader = GgufFile(path)
    except GgufError as exc:
        raise ModelFormatError(str(exc)) from exc
    weights = ModelWeights({})
    for tensor in reader.tensors:
        if tensor.name in _GGUF_CONFIG_TENSORS:
            continue
        hf_name = _gguf_to_hf_name(tensor.name)
        if hf_name is None:
            # Non-weight tensors we know we do not need (e.g. precomputed rope factors) are
            # rejected loudly rather than silently producing a different model.
            raise ModelFormatError(f"{path}: unexpected GGUF tensor {tensor.name!r}")
        if not wanted(hf_name):
            continue
        # Quantized blocks (Q4_1, Q8_0, ...) and plain F16/BF16/F32 all come back as float32,
        # shaped like the HF tensor ([out_features, in_features] for matrices).
        blocks = _quant_blocks(tensor.data, tensor.type_name)
        if blocks is not None:   # gguf's own formula, on whole tensors at once
            weight = (blocks.scales.repeat_interleave(QUANT_BLOCK, dim=1) * blocks.values
                      + blocks.offsets.repeat_interleave(QUANT_BLOCK, dim=1))
        else:
            weight = torch.from_numpy(dequantize(tensor.data, tensor.type_id).copy())
        num_heads = {"attn_q.weight": config.num_heads, "attn_q.bias": config.num_heads,
                     "attn_k.weight": config.num_kv_heads, "attn_k.bias": config.num_kv_heads,
                     }.get(tensor.name.split(".", 2)[-1]) if config.architecture == "llama" \
            else None
        if num_heads is not None:
            weight = unpermute_llama_cpp_rows(weight, num_heads)
            if blocks is not None:
                blocks = QuantBlocks(*(unpermute_llama_cpp_rows(t, num_heads) for t in
                                       (blocks.values, blocks.scales, blocks.offsets)),
                                     blocks.bits)
        weights.tensors[hf_name] = weight
        if blocks is not None:
            weights.quant[hf_name] = blocks
    return weights


def _quant_blocks(data: np.ndarray, type_name: str) -> QuantBlocks | None:
    """The values, scales and offsets of a Q4_0 / Q4_1 / Q8_0 matrix; None for other types.

    A ggml block covers 32 weights of a row: a float16 scale d (Q4_1: then a float16 min m),
    then the values. Q4: 16 bytes whose low nibbles are weights 0..15 and high nibbles weights
    16..31; Q4_0: w = d * q - 8 d, Q4_1: w = d * q + m. Q8_0: 32 int8, w = d * q.
    """
    header, bits = {"Q4_0": (2, 4), "Q4_1": (4, 4), "Q8_0": (2, 8)}.get(type_name, (0, 0))
    if not header or data.ndim != 2:
        return None
    num_rows = data.shape[0]
    raw = torch.from_numpy(data.copy())
    raw = raw.view(num_rows, -1, header + QUANT_BLOCK * bits // 8)  # [rows, groups, bytes]
    scales = raw[..., 0:2].contiguous().view(torch.float16)[..., 0].float()   # [rows, groups]
    if header == 4:
        offsets = raw[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    else:
        offsets = -8 * scales if bits == 4 else torch.zeros_like(scales)
    packed = raw[..., header:]
    if bits == 8:
        values = packed.contiguous().view(torch.int8).reshape(num_rows, -1)
    else:
        values = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(num_rows, -1)
    return QuantBlocks(values, scales, offsets, bits)


# ------------------------------------------------------------------------------ HF directories


def _load_hf_dir(path: Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file_name in files:
        with safe_open(str(path / file_name), framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    tensors[name] = f.get_tensor(name)
    return tensors
