"""Tiny random-weight models of every family splitserve loads, as HF directories (tests).

    python scripts/random_family.py OUT_DIR --family llama|qwen2|qwen3|mistral
                                    [--set KEY=JSON ...] [--vocab N] [--tokenizer] [--seed N]

The sibling of scripts/random_model.py (the benchmark shapes): the same weight spread
(`spread_weights`: unit-gain matrices, so that greedy output depends on the context), plus
what a family adds and transformers initialises to a no-op: q/k/v/o biases (zeros) are drawn
normal with std BIAS_STD, Qwen3's q/k norm weights (ones) uniform in [0.5, 1.5], so a model
that skipped either would give other tokens. As there, config.json is written by hand with
only the keys the loader knows (`family_config`), and `--set` changes or adds keys (RoPE
scaling, windows, layer types; JSON null writes null). `--tokenizer` adds
SmolLM2's tokenizer (from the installed GGUF; the vocabulary must then be at least 49152).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.random_model import (  # noqa: E402
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    INIT_STD,
    export_tokenizer,
    spread_weights,
)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
BIAS_STD = 0.5
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def family_config(family: str, num_layers: int = 2, vocab_size: int = 512,
                  **changes: object) -> dict[str, object]:
    """config.json of a tiny model: hidden 64, 4 query / 2 KV heads of 16 (Qwen3: of 32,
    head_dim apart from hidden / heads as in real Qwen3), `changes` on top (None: null)."""
    config: dict[str, object] = {
        "architectures": [_CLASSES[family]], "model_type": family,
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32 if family == "qwen3" else 16, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "initializer_range": INIT_STD,
        "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID,
    }
    config.update({
        "llama": {"attention_bias": False, "mlp_bias": False},
        "qwen2": {"use_sliding_window": False, "sliding_window": None},
        "qwen3": {"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
        "mistral": {"sliding_window": None},
    }[family])
    config.update(changes)
    return config


def hf_model(config: dict[str, object], seed: int = 0):  # type: ignore[no-untyped-def]
    """transformers' model for the config, fp32, with spread weights (module docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items()
                                        if k not in ("architectures", "dtype")})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    spread_weights(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, BIAS_STD, generator=generator)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5, generator=generator)
    return model


def build_family_model(out_dir: Path, family: str, *, seed: int = 0, num_layers: int = 2,
                       vocab_size: int = 512, tokenizer: bool = False,
                       **changes: object):  # type: ignore[no-untyped-def]
    """Writes the HF directory into `out_dir` (created) and returns transformers' model on
    the same weights (the tests' oracle)."""
    config = family_config(family, num_layers, vocab_size, **changes)
    model = hf_model(config, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}, indent=2) + "\n")
    if tokenizer:
        export_tokenizer(out_dir)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="a config.json key's value, as JSON")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", action="store_true", help="add SmolLM2's tokenizer")
    a = p.parse_args(argv)
    changes = {key: json.loads(value) for key, value in (s.split("=", 1) for s in a.set)}
    build_family_model(a.out_dir, a.family, seed=a.seed, num_layers=a.layers,
                       vocab_size=a.vocab, tokenizer=a.tokenizer, **changes)
    print(f"{a.out_dir}: random {a.family} model ({a.layers} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
