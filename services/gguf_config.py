"""A GGUF file's metadata and tensor names -> `ModelConfig` (services/model_config.py holds the
types and the HF-directory reader; `load_model_config` calls this for `.gguf` paths).

Architectures are llama.cpp's names: `llama` (Mistral's GGUFs are `llama` too), `qwen2`,
`qwen3`. Biases and Qwen3's q/k norms have no metadata key: the tensors say (every layer must
carry the same set). Llama 3.x stores its RoPE scaling as a `rope_freqs.weight` tensor (each
frequency's divisor) with no metadata key at all: it becomes `RopeScaling("freq_factors")`,
read here (a few hundred bytes of the memory map). Strictness is model_config's: an `<arch>.*`
key or a tensor this does not know is refused, naming it.
"""

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

from services.gguf_file import GgufError, GgufFile
from services.model_config import (
    ModelConfig,
    ModelFormatError,
    RopeScaling,
    accept_any,
    accept_only,
    check_key,
)

ARCHITECTURES = ("llama", "qwen2", "qwen3")


def config_from_gguf(path: Path) -> ModelConfig:
    try:
        gguf = GgufFile(path)
    except GgufError as exc:
        raise ModelFormatError(str(exc)) from exc
    meta = {name: value for name, value in gguf.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    tensors = {t.name: t for t in gguf.tensors}
    arch = str(meta["general.architecture"])
    if arch not in ARCHITECTURES:
        raise ModelFormatError(f"{path}: architecture {arch!r} is not supported "
                               f"({', '.join(ARCHITECTURES)})")

    def get(key: str, default: object = None) -> object:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"{path}: metadata {arch}.{key} missing")
        return value

    num_heads = int(get("attention.head_count"))  # type: ignore[call-overload]
    hidden = int(get("embedding_length"))  # type: ignore[call-overload]
    num_layers = int(get("block_count"))  # type: ignore[call-overload]
    head_dim = int(get("attention.key_length", hidden // num_heads))  # type: ignore
    _check_metadata(path, meta, arch, head_dim)
    extras = _check_tensors(path, tensors, num_layers)
    tokens = gguf.fields.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else 0)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    max_len = int(get("context_length"))  # type: ignore[call-overload]
    return ModelConfig(
        name=path.stem,
        architecture=arch,
        vocab_size=int(vocab),  # type: ignore[call-overload]
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),  # type: ignore[call-overload]
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),  # type: ignore
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),  # type: ignore[arg-type]
        max_model_len=max_len,
        # GGUF stores a separate output.weight only when the head is not tied.
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(bos) if bos is not None else None,  # type: ignore[call-overload]
        eos_token_ids=(int(eos),) if eos is not None else (),  # type: ignore[call-overload]
        rope_scaling=_rope_scaling(path, meta, arch, tensors, head_dim, max_len),
        attention_bias="attn_q.bias" in extras,
        o_proj_bias="attn_output.bias" in extras,
        qk_norm="attn_q_norm.weight" in extras,
    )


def _rope_scaling(path: Path, meta: Mapping[str, object], arch: str,
                  tensors: Mapping[str, object], head_dim: int,
                  max_len: int) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor") or 1.0)  # type: ignore[arg-type]
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length")  # type: ignore
                   or max_len)
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        if kind != "none":
            raise ModelFormatError(f"{path}: rope_freqs.weight together with "
                                   f"{arch}.rope.scaling.type {kind!r}")
        values = np.asarray(freqs.data, dtype=np.float32).reshape(-1)  # type: ignore
        if values.shape != (head_dim // 2,):
            raise ModelFormatError(f"{path}: rope_freqs.weight has {values.size} values, "
                                   f"expected head_dim / 2 = {head_dim // 2}")
        return RopeScaling("freq_factors", freq_factors=tuple(float(v) for v in values))
    if kind == "none" or factor == 1.0 and kind == "linear":
        return None
    return RopeScaling(str(kind), factor=factor, original_max_position_embeddings=original)


# Keys after "<arch>.", head_dim filled in per file.
def _metadata_keys(head_dim: int) -> dict[str, Callable[[object], bool]]:
    return {
        **{key: accept_any for key in (
            "context_length", "embedding_length", "block_count", "feed_forward_length",
            "attention.head_count", "attention.head_count_kv", "attention.key_length",
            "attention.layer_norm_rms_epsilon", "rope.freq_base", "vocab_size",
            "rope.scaling.original_context_length",
            "rope.scaling.finetuned",     # whether the checkpoint was trained scaled: no effect
            # Which checkpoint layout llama.cpp converted from; a GGUF always holds llama.cpp's
            # own layout, which the weight loader undoes, so the value changes nothing.
            "tensor_data_layout")},
        "attention.value_length": accept_only(head_dim),
        "rope.dimension_count": accept_only(head_dim),     # partial rotary: not computed
        "rope.scaling.type": accept_only("none", "linear", "yarn"),
        "rope.scaling.factor": accept_any,
        "rope.scale_linear": accept_only(1.0),
        "expert_count": accept_only(0),
        "expert_used_count": accept_only(0),
    }


def _check_metadata(path: Path, meta: Mapping[str, object], arch: str, head_dim: int) -> None:
    known = _metadata_keys(head_dim)
    for name, value in meta.items():
        if name.startswith(f"{arch}."):
            check_key(path, "GGUF metadata", name, value, known.get(name[len(arch) + 1:]))
    # Other namespaces describe the file (general.*), the tokenizer (tokenizer.*, read by the
    # scheduler's tokenizer, which refuses what it cannot build) or quantization (quantize.*).
    if meta.get("general.type", "model") != "model":
        raise ModelFormatError(f"{path}: general.type {meta['general.type']!r} is not a model")
    if int(meta.get("split.count", 1)) > 1:  # type: ignore[call-overload]
        raise ModelFormatError(f"{path}: split GGUF files are not supported; merge the parts")


GLOBAL_TENSORS = frozenset({"token_embd.weight", "output_norm.weight", "output.weight",
                            "rope_freqs.weight"})
LAYER_TENSORS = frozenset({
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_norm.weight",
    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ffn_norm.weight"})
# Optional per layer, the same set in every layer: q/k/v biases come as a three.
OPTIONAL_LAYER_TENSORS = frozenset({"attn_q.bias", "attn_k.bias", "attn_v.bias",
                                    "attn_output.bias", "attn_q_norm.weight",
                                    "attn_k_norm.weight"})
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_TENSOR_HINTS = {
    "ffn_gate.bias": "MLP biases",
    "_exps.": "mixture-of-experts layers",
    "ffn_gate_inp": "mixture-of-experts router",
}


def _check_tensors(path: Path, names: Iterable[str], num_layers: int) -> frozenset[str]:
    """Every tensor must be one the decoder uses: the weight loader skips the rest, so an
    extra tensor means computation we would silently leave out. Returns the optional layer
    tensors present."""
    extras: list[set[str]] = [set() for _ in range(num_layers)]
    for name in names:
        match = _LAYER_TENSOR.fullmatch(name)
        if match is not None and int(match[1]) < num_layers and match[2] in OPTIONAL_LAYER_TENSORS:
            extras[int(match[1])].add(match[2])
        elif name in GLOBAL_TENSORS or (match is not None and int(match[1]) < num_layers
                                        and match[2] in LAYER_TENSORS):
            continue
        else:
            hint = next((h for part, h in _TENSOR_HINTS.items() if part in name), None)
            raise ModelFormatError(
                f"{path}: tensor {name!r} is not part of the decoder splitserve computes"
                + (f" ({hint} is not supported yet)" if hint else ""))
    found = frozenset(extras[0]) if extras else frozenset()
    biases = found & {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
    norms = found & {"attn_q_norm.weight", "attn_k_norm.weight"}
    if any(layer != found for layer in extras) or len(biases) not in (0, 3) \
            or len(norms) not in (0, 2):
        raise ModelFormatError(f"{path}: layers carry different or incomplete bias / q-k norm "
                               f"tensors (layer 0: {sorted(found)})")
    return found
