"""What an 8-bit KV cache (--kv-cache-dtype fp8*) or int8 matmuls (--quantization int8) cost
in accuracy, against the same model, weights and compute dtype with neither.

Both models run the same prompts in one batch: a prefill of every prompt, then decode steps.
The reference decodes greedily; the candidate is fed the reference's tokens (teacher forcing),
so every step compares the two on the same context. Per step:
- |delta logprob| of the reference's chosen token (log-softmax of each model's logits);
- top-1 agreement: the candidate's argmax is the reference's token, counted over the steps
  where the reference's best two tokens are more than NEAR_TIE_NATS apart (a near-tie may go
  either way under any rounding change, even between two CPU levels);
- greedy exactness: a free-running candidate repeats the reference's first N tokens exactly
  iff its argmax matched at each of those N teacher-forced steps (until the first miss the
  two runs see the same context), so "prompts token-exact for the first N" comes from the
  same run.

    .venv/bin/python bench/quant_accuracy.py --dtype float32 --kv-cache-dtype fp8
    .venv/bin/python bench/quant_accuracy.py --dtype bfloat16 --quantization int8

Prompts: the shared workload's 64 (../shared/bench/workload.py, when present), the worker
tests' short and chat prompts, and a long chat prompt (a ~1,400-token document), each
tokenized with the model's own tokenizer. The tests (tests/worker_svc/test_kv_fp8_accuracy.py)
run a subset and hold the bounds.
"""

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.model_config import ModelConfig, default_model_path, load_model_config  # noqa: E402
from worker_svc.attention import build_attention_metadata  # noqa: E402
from worker_svc.kernels import CpuLevel  # noqa: E402
from worker_svc.kernels.kv_quant import kv_cache_dtype  # noqa: E402
from worker_svc.kv_cache import KvLayerSpec, allocate_kv_caches, layer_caches  # noqa: E402
from worker_svc.model.llama import LlamaModel  # noqa: E402
from worker_svc.model_loader import load_model  # noqa: E402

BLOCK = 16
NEAR_TIE_NATS = 0.1     # reference top-2 logprob gap below which a step is a near-tie
SHARED = Path(__file__).resolve().parents[2] / "shared" / "bench"


@dataclass(frozen=True, slots=True)
class Variant:
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    quantization: str = ""


@dataclass(slots=True)
class Agreement:
    """The candidate against the reference, over every decode step of every prompt."""

    steps: int
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    top1_outside_near_ties: float      # share of the steps that are not near-ties
    near_ties: int
    exact_prompts: int                 # prompts whose first `exact_tokens` tokens match
    prompts: int
    exact_tokens: int
    first_miss: list[int]              # per prompt: the first step whose argmax differs, or -1


def build_model(config: ModelConfig, path: str | Path, variant: Variant,
                level: CpuLevel | None = None, kernels: str | None = None) -> LlamaModel:
    """The whole model on the CPU for `variant` (dense weights: the GGUF's quantized blocks
    are not used, so both sides multiply the same dense values)."""
    model, _ = load_model(config, path, variant.dtype, torch.device("cpu"), 0, None, True, None,
                          level, kernels, False,
                          kv_cache_dtype(variant.kv_cache_dtype, variant.dtype),
                          variant.quantization)
    return model


def run(model: LlamaModel, kv_dtype: torch.dtype, prompts: list[list[int]], num_steps: int,
        forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt (one step), then `num_steps` decode steps of every prompt. Each
    step feeds the token chosen greedily, or `forced[p][i]`. Returns the fed tokens per prompt
    and per step the float32 log-softmax [prompts, vocab] it was chosen from."""
    config = model.config
    tables, next_block = [], 1
    for prompt in prompts:
        count = -(-(len(prompt) + num_steps + 1) // BLOCK)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    positions = sorted(set(model.layer_positions))
    spec = KvLayerSpec(BLOCK, model.shard.num_kv_heads, config.head_dim, kv_dtype)
    tensors = allocate_kv_caches([spec] * len(positions), next_block)
    caches = layer_caches(tensors, positions, model.layer_positions)
    lens = [len(p) for p in prompts]
    meta = build_attention_metadata(lens, [0] * len(prompts), tables, BLOCK, next_block)
    ids = torch.tensor([t for p in prompts for t in p])
    last_rows = torch.tensor(lens).cumsum(0) - 1
    chosen: list[list[int]] = [[] for _ in prompts]
    logprobs = []
    with torch.inference_mode():
        hidden, residual = model.forward(ids, None, None, meta.positions, meta, caches)
        logits = model.compute_logits(hidden[last_rows], residual[last_rows])
        for step in range(num_steps):
            lp = torch.log_softmax(logits.float(), dim=-1)
            logprobs.append(lp)
            picks = (lp.argmax(-1).tolist() if forced is None
                     else [f[step] for f in forced])
            for p, token in enumerate(picks):
                chosen[p].append(token)
            if step + 1 == num_steps:
                break
            context = [n + step for n in lens]
            meta = build_attention_metadata([1] * len(prompts), context, tables, BLOCK,
                                            next_block)
            hidden, residual = model.forward(torch.tensor(picks), None, None, meta.positions,
                                             meta, caches)
            logits = model.compute_logits(hidden, residual)
    return chosen, logprobs


def agreement(reference: list[list[int]], ref_lp: list[torch.Tensor],
              cand_lp: list[torch.Tensor], exact_tokens: int) -> Agreement:
    """The candidate's teacher-forced log-probs against the reference's run."""
    chosen = torch.tensor(reference)                            # [prompts, steps]
    ref = torch.stack(ref_lp, dim=1)                            # [prompts, steps, vocab]
    cand = torch.stack(cand_lp, dim=1)
    picked = chosen[..., None]
    delta = (ref.gather(-1, picked) - cand.gather(-1, picked)).abs().squeeze(-1)
    top2 = ref.topk(2, dim=-1).values
    near_tie = (top2[..., 0] - top2[..., 1]) < NEAR_TIE_NATS
    agree = cand.argmax(-1) == chosen
    counted = ~near_tie
    misses = ~agree
    first_miss = [int(row.nonzero()[0]) if row.any() else -1 for row in misses]
    exact = sum(1 for m in first_miss if m < 0 or m >= exact_tokens)
    return Agreement(
        steps=int(chosen.numel()), mean_abs_dlogprob=float(delta.mean()),
        max_abs_dlogprob=float(delta.max()),
        top1_outside_near_ties=float(agree[counted].float().mean()) if counted.any() else 1.0,
        near_ties=int(near_tie.sum()), exact_prompts=exact, prompts=len(reference),
        exact_tokens=exact_tokens, first_miss=first_miss)


def compare(prompts: list[list[int]], reference: Variant, candidate: Variant, num_steps: int,
            exact_tokens: int = 32, level: CpuLevel | None = None,
            kernels: str | None = None) -> Agreement:
    """The candidate variant against the reference variant on `prompts` (module docstring)."""
    path = default_model_path()
    config = load_model_config(path)
    ref_model = build_model(config, path, reference, level, kernels)
    ref_tokens, ref_lp = run(ref_model, kv_cache_dtype(reference.kv_cache_dtype,
                                                       reference.dtype), prompts, num_steps)
    del ref_model
    cand_model = build_model(config, path, candidate, level, kernels)
    _, cand_lp = run(cand_model, kv_cache_dtype(candidate.kv_cache_dtype, candidate.dtype),
                     prompts, num_steps, forced=ref_tokens)
    return agreement(ref_tokens, ref_lp, cand_lp, exact_tokens)


def workload_prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The shared workload's 64 chat prompts, tokenized (none where ../shared is absent)."""
    if not (SHARED / "workload.py").is_file():
        return []
    sys.path.insert(0, str(SHARED))
    try:
        from workload import PROMPTS  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(SHARED))
    return [tokenizer.encode(text) for text in PROMPTS]


def long_chat_prompt(tokenizer, repeats: int = 12) -> list[int]:  # type: ignore[no-untyped-def]
    """A ~1,400-token chat prompt: a document of numbered notes as the system message, then a
    question about it."""
    notes = " ".join(f"Note {i}: the shipment of {i * 7} crates left the harbour on day {i} "
                     f"and reached the northern warehouse two days later." for i in range(
                         repeats * 4))
    text = (f"<|im_start|>system\n{notes}<|im_end|>\n<|im_start|>user\nWhich day did the "
            f"shipment of 35 crates leave, and where did it go?<|im_end|>\n"
            f"<|im_start|>assistant\n")
    return tokenizer.encode(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default="")
    p.add_argument("--steps", type=int, default=64, help="decode steps per prompt")
    p.add_argument("--exact-tokens", type=int, default=32)
    p.add_argument("--cpu-level", default=None, help="force a CPU level (default: the best)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    from scheduler_svc.frontend.tokenizer import load_tokenizer
    from tests.worker_svc.common import PROMPTS

    tokenizer = load_tokenizer(default_model_path())
    prompts = workload_prompts(tokenizer) + list(PROMPTS.values()) + [long_chat_prompt(tokenizer)]
    dtype = getattr(torch, a.dtype)
    level = None if a.cpu_level is None else CpuLevel[a.cpu_level.upper()]
    result = compare(prompts, Variant(dtype), Variant(dtype, a.kv_cache_dtype, a.quantization),
                     a.steps, a.exact_tokens, level)
    figures = {k: v for k, v in asdict(result).items() if k != "first_miss"}
    print(f"{a.dtype}, kv cache {a.kv_cache_dtype}, quantization {a.quantization or 'none'}, "
          f"{len(prompts)} prompts x {a.steps} steps:")
    print(json.dumps(figures, indent=1))
    misses = [m for m in result.first_miss if m >= 0]
    print(f"first miss per prompt (step): median "
          f"{sorted(misses)[len(misses) // 2] if misses else 'none'}, "
          f"{len(misses)} of {len(prompts)} prompts miss within {a.steps} steps")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)},
                                      **asdict(result)}, indent=1))
    return 0 if math.isfinite(result.mean_abs_dlogprob) else 1


if __name__ == "__main__":
    sys.exit(main())
