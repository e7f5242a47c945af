"""Tiny random-weight models of every family splitserve loads, as HF directories (tests).

    python scripts/random_family.py OUT_DIR --family llama|qwen2|qwen3|mistral
                                    [--set KEY=JSON ...] [--vocab N] [--tokenizer] [--seed N]

The sibling of scripts/random_model.py (the benchmark shapes): the same weight spread
(`spread_weights`: unit-gain matrices, so that greedy output depends on the context), plus
what a family adds and transformers initialises to a no-op: q/k/v/o biases (zeros) are drawn
normal with std BIAS_STD (o_proj's smaller: a constant on the residual stream soon repeats
one token), Qwen3's q/k norm weights (ones) uniform in [0.5, 1.5], so a model
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
BIAS_STD = 0.5            # q/k/v biases
O_BIAS_STD = 0.05         # o_proj's: added to the residual stream as it is, every token
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
                std = O_BIAS_STD if name.endswith("o_proj.bias") else BIAS_STD
                param.normal_(0.0, std, generator=generator)
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


def write_gguf(model, path: Path) -> Path:  # type: ignore[no-untyped-def]
    """transformers' `model` as a float32 GGUF in llama.cpp's layout: architecture `llama`
    (Mistral's too; q/k rows permuted per head for llama.cpp's interleaved RoPE, and a Llama 3
    RoPE scaling as the `rope_freqs.weight` divisors), `qwen2` or `qwen3` (unpermuted). No
    tokenizer: the tests that read these drive the worker's runner with token ids."""
    import numpy as np
    from gguf import GGUFWriter

    cfg = model.config
    arch = {"mistral": "llama"}.get(cfg.model_type, cfg.model_type)
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    tensors = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    if cfg.rope_parameters.get("rope_type") == "llama3":
        plain = 1.0 / (cfg.rope_parameters["rope_theta"] ** (
            np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
        writer.add_tensor("rope_freqs.weight",
                          (plain / model.model.rotary_emb.inv_freq.numpy()).astype(np.float32))

    def interleave(rows: "np.ndarray", num_heads: int) -> "np.ndarray":
        if arch != "llama":
            return rows
        per_head = rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:])
        return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(rows.shape)

    names = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    for gguf_name, hf_name in names.items():
        writer.add_tensor(gguf_name, tensors[hf_name])
    layer_names = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    for i in range(cfg.num_hidden_layers):
        for gguf_part, hf_part in layer_names.items():
            for kind in ("weight", "bias"):
                hf_name = f"model.layers.{i}.{hf_part}.{kind}"
                if hf_name in tensors:
                    heads = {"attn_q": cfg.num_attention_heads,
                             "attn_k": cfg.num_key_value_heads}.get(gguf_part)
                    value = tensors[hf_name]
                    writer.add_tensor(f"blk.{i}.{gguf_part}.{kind}",
                                      value if heads is None else interleave(value, heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
