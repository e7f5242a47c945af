"""Random-weight Llama models in the shapes the GPU benchmark and tests run, as HF directories.

    python scripts/random_model.py OUT_DIR --shape smollm2|llama-1b [--seed N] [--layers N]
                                   [--dtype bfloat16|float32] [--tokenizer PATH] [--force]
    python scripts/random_model.py --export-tokenizer DIR

Why random weights: the GPU machines have no network and room for 64 MiB of extra files, so
neither SmolLM2's 98 MB GGUF nor a 1B checkpoint can travel there. Throughput depends on the
shape only, and greedy token-exactness against HF transformers holds for any weights, so a
model built on the spot serves both. The SmolLM2 tokenizer (3.5 MB) does travel: export it here
once with `--export-tokenizer` (from the installed GGUF, through transformers) and pass the
directory with `--tokenizer` there.

Shapes:
- smollm2: SmolLM2-135M (576 hidden, 1536 intermediate, 30 layers, 9/3 heads, head_dim 64,
  vocab 49152, tied embeddings, rope theta 1e5).
- llama-1b: Llama-3.2-1B (2048 hidden, 8192 intermediate, 16 layers, 32/8 heads, head_dim 64,
  vocab 128256, tied embeddings, rope theta 5e5) without its rope_scaling (the shape alone
  sets the speed). Its vocabulary is larger than the SmolLM2 tokenizer's 49152 ids: ids above 49151
  never appear in a prompt, but the embedding and the head keep their full 128256 rows, so the
  memory traffic and the logits' cost per step are the 1B model's own.

Weights (`spread_weights`, seeded): the token embedding (tied to the LM head) normal with std
0.02 as transformers initialises it, every other matrix normal with std 1/sqrt(fan_in), layer
RMSNorm weights 1 and the final norm's FINAL_NORM_SCALE. transformers' own initialisation (std
0.02 everywhere) leaves the layers' contributions far below the input token's embedding, and
with tied embeddings the greedy output then repeats one token after a step or two (measured on
the SmolLM2 shape: 2-3 distinct tokens in 32), so a token-for-token check sees almost nothing.
With unit-gain matrices the layers dominate the residual stream and the next token depends on
the context (5-32 distinct tokens in 32 on the same prompts, 4 to 30 layers); the final norm's
scale spreads the logits (std about 2, like a trained model's) so that top-1 margins are not
lost in bf16 rounding. Activations stay finite in bf16 and fp16. `--layers` shrinks the depth
for tests. config.json is written here rather than taken from save_pretrained, with
only keys splitserve's loader knows: transformers versions differ in what they add (the GPU
machines run 5.17, this one 5.23), and the loader refuses a key it does not know.

The OUT_DIR gets config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and random_model.json (the build arguments): a later call with the same
arguments reuses the directory, with other arguments it stops unless --force.
"""

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# SmolLM2's tokenizer: <|im_start|> is both BOS and the ChatML turn opener, <|im_end|> the EOS.
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
TOKENIZER_VOCAB = 49152
INIT_STD = 0.02           # the token embedding (and an untied LM head)
FINAL_NORM_SCALE = 4.0    # the final RMSNorm's weight: logits with std about 2
STAMP = "random_model.json"


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama decoder's dimensions (the fields splitserve's ModelConfig reads)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float = 1e-5
    # No rope scaling, so positions past the training length mean nothing; 8192 leaves room
    # for any benchmark prompt.
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True


SHAPES = {
    "smollm2": Shape(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, vocab_size=49152, rope_theta=1e5),
    "llama-1b": Shape(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, vocab_size=128256, rope_theta=5e5),
}


def hf_config(shape: Shape, num_layers: int, dtype: str) -> dict[str, object]:
    """config.json: the shape in transformers 5's Llama keys, nothing else."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "dtype": dtype,
    }


# ------------------------------------------------------------------------------- tokenizer


def export_tokenizer(out_dir: Path, source: Path | None = None) -> Path:
    """Writes tokenizer.json and tokenizer_config.json (special tokens, chat template) into
    `out_dir`. `source`: a tokenizer.json, or a directory holding one (and maybe its
    tokenizer_config.json), copied as they are; None: SmolLM2's, from the installed GGUF."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if source is not None:
        source_dir = source if source.is_dir() else source.parent
        tokenizer_json = source if source.is_file() else source / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise SystemExit(f"--tokenizer {source}: no tokenizer.json there")
        shutil.copyfile(tokenizer_json, out_dir / "tokenizer.json")
        config = source_dir / "tokenizer_config.json"
        if config.is_file():
            shutil.copyfile(config, out_dir / "tokenizer_config.json")
        else:
            _write_tokenizer_config(out_dir, chat_template=None)
        return out_dir
    _export_from_gguf(out_dir)
    return out_dir


def _export_from_gguf(out_dir: Path) -> None:
    """SmolLM2's tokenizer.json as transformers builds it from the GGUF's vocabulary. Our own
    tokenizer_config.json goes beside it: the one transformers writes names its 5.x backend
    class, which older versions cannot map."""
    sys.path.insert(0, str(ROOT))
    from services.model_config import ModelFormatError, default_model_path

    try:
        gguf = default_model_path()
    except ModelFormatError as exc:
        raise SystemExit(f"no tokenizer source: {exc}; pass --tokenizer PATH (a tokenizer.json "
                         "exported with --export-tokenizer on a machine with the GGUF)") from exc
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        shutil.copyfile(Path(tmp) / "tokenizer.json", out_dir / "tokenizer.json")
    _write_tokenizer_config(out_dir, chat_template=tok.chat_template)


def _write_tokenizer_config(out_dir: Path, chat_template: str | None) -> None:
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "model_max_length": 8192,
    }
    if chat_template:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ------------------------------------------------------------------------------- the model


def spread_weights(model: "torch.nn.Module", seed: int = 0) -> None:  # noqa: F821
    """Re-draws a Llama's weights so that its greedy output is diverse (module docstring):
    embeddings std INIT_STD, other matrices std 1/sqrt(fan_in), the final norm's weight
    FINAL_NORM_SCALE, layer norms 1. Used by the tests' own small models too."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():   # a tied head is the embedding
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                param.normal_(0.0, INIT_STD, generator=generator)
            elif param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
            elif name == "model.norm.weight":
                param.fill_(FINAL_NORM_SCALE)


def build_model(out_dir: Path, shape_name: str, *, seed: int = 0, num_layers: int | None = None,
                dtype: str = "bfloat16", tokenizer: Path | None = None,
                force: bool = False) -> Path:
    """Builds (or reuses) the random model in `out_dir`; returns `out_dir`."""
    shape = SHAPES[shape_name]
    num_layers = num_layers or shape.num_layers
    stamp = {"shape": shape_name, "seed": seed, "num_layers": num_layers, "dtype": dtype,
             "dims": asdict(shape), "init": "spread"}
    if (out_dir / STAMP).is_file() and not force:
        built = json.loads((out_dir / STAMP).read_text())
        if built == stamp:
            return out_dir
        differ = ", ".join(f"{key} {built.get(key)!r} (asked {value!r})"
                           for key, value in stamp.items() if built.get(key) != value)
        raise SystemExit(f"{out_dir} holds a model built with other arguments: {differ}; "
                         "pass --force to rebuild")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / STAMP).is_file():
        raise SystemExit(f"{out_dir} exists and was not made by this script; not touching it")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_dict = hf_config(shape, num_layers, dtype)
    config = LlamaConfig(**{k: v for k, v in config_dict.items()
                            if k not in ("architectures", "model_type", "dtype")})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    spread_weights(model, seed)
    model.to({"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype])

    # Built beside the target and renamed into place: a directory that exists is complete.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}, indent=2) + "\n")
        export_tokenizer(tmp, tokenizer)
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        # mkdtemp and safetensors make owner-only files; a container's user must read them.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", type=Path, help="the HF directory to write")
    p.add_argument("--shape", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None,
                   help="fewer decoder layers than the shape's (tests)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the stored weights; bf16 values load exactly into float32")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json (or a directory with it) to copy; default: SmolLM2's "
                   "from the installed GGUF")
    p.add_argument("--export-tokenizer", type=Path, metavar="DIR", default=None,
                   help="only write SmolLM2's tokenizer.json + tokenizer_config.json into DIR")
    p.add_argument("--force", action="store_true", help="rebuild OUT_DIR whatever it holds")
    a = p.parse_args(argv)
    if a.export_tokenizer is not None:
        if a.out_dir is not None or a.shape is not None:
            p.error("--export-tokenizer takes no OUT_DIR or --shape")
        path = export_tokenizer(a.export_tokenizer, a.tokenizer)
        print(f"wrote {path}/tokenizer.json and tokenizer_config.json")
        return 0
    if a.out_dir is None or a.shape is None:
        p.error("OUT_DIR and --shape are required (or --export-tokenizer DIR)")
    if a.layers is not None and a.layers < 1:
        p.error("--layers must be at least 1")
    build_model(a.out_dir, a.shape, seed=a.seed, num_layers=a.layers, dtype=a.dtype,
                tokenizer=a.tokenizer, force=a.force)
    print(f"{a.out_dir}: random {a.shape} model ({a.layers or SHAPES[a.shape].num_layers} "
          f"layers, {a.dtype}, seed {a.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
