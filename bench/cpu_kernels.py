"""The C kernels (worker_svc/kernels) against the torch path, side by side, at one CPU level.

    .venv/bin/python bench/cpu_kernels.py [--dtype bfloat16] [--layers 30] [--level avx2]
                                          [--only attention|fp8|matmul] [--threads 2]

(Not named kernels.py: transformers imports a top-level `kernels` module when one exists.)

Attention: SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64), 16-token blocks
scattered over a cache per layer (so K/V come from memory, as in a real step, not from cache),
for decode batches of several sizes and context lengths and for prefill chunks (one 512-token
chunk, fresh or after 512 cached tokens; 16 prompts of 176); median milliseconds per step (all
layers) of the torch path, the level's kernel (paged_attention.c) and, at level amx in
bfloat16, the AMX kernel (paged_attention_amx.c).

fp8 KV cache: the level's attention kernel (the AMX one where it takes the step) reading a
cache in the compute dtype against one in float8 e4m3fn and e5m2 (`--kv-cache-dtype fp8`,
`fp8_e5m2`), in bfloat16 and float32 compute whatever --dtype says: decodes of 64 requests x
180 keys and 1 x 2000, one 512-token prefill chunk; median ms per step and fp8 / plain.

Matmuls: SmolLM2's five weight shapes at decode and prefill row counts, each with `--layers`
distinct weights so that they come from memory as in the model: GFLOP/s of the level's kernel
(worker_svc.kernels.gemm) and of torch's own (oneDNN where the model uses it, else
F.linear). Writes a JSON result to bench/results/.
"""

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))
from bench_io import write_result  # noqa: E402

from worker_svc.attention import (  # noqa: E402
    AttentionMetadata,
    build_attention_metadata,
    paged_attention,
)
from worker_svc.kernels import LayerKernels, PagedAttentionKernel, load_cpu_kernels  # noqa: E402
from worker_svc.kernels.cpu import CpuLevel, cpu_model, detect_level  # noqa: E402
from worker_svc.kernels.kv_quant import FP8_DTYPES  # noqa: E402
from worker_svc.kernels.paged_attention import (  # noqa: E402
    AmxPagedAttentionKernel,
    paged_attention_kernel,
)
from worker_svc.model.llama import Linear  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def attend_all(caches: list[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               meta: AttentionMetadata, kernel: PagedAttentionKernel | None) -> None:
    """One step's attention over every layer (k doubles as v)."""
    for cache in caches:
        paged_attention(q, k, k, cache, meta, kernel)


def time_per_step(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def median_ms(fn, budget_ms: float = 3000.0) -> float:
    """Median of single calls after a warm-up, as many as fit the budget (3 to 25)."""
    fn()
    times = []
    while len(times) < 3 or (len(times) < 25 and sum(times) < budget_ms):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# (label, query tokens per request, cached tokens per request, requests)
STEPS = [("decode", 1, 180, 1), ("decode", 1, 2000, 1), ("decode", 1, 180, 16),
         ("decode", 1, 180, 64), ("decode", 1, 1000, 64), ("prefill", 512, 0, 1),
         ("prefill", 512, 512, 1), ("prefill", 176, 0, 16)]


def bench_attention(kernel: PagedAttentionKernel, dtype: torch.dtype, layers: int) -> list[dict]:  # type: ignore[type-arg]
    """Torch path, the level's kernel (paged_attention.c) and, at level amx in bfloat16, the
    AMX kernel (paged_attention_amx.c); medians, ms per step (all layers)."""
    gen = torch.Generator().manual_seed(0)
    amx = kernel if isinstance(kernel, AmxPagedAttentionKernel) else None
    twin = amx.twin() if amx is not None else kernel
    rows = []
    print(f"attention, {dtype}, {layers} layers, ms per step (medians)")
    print(f"{'step':>7} {'requests':>8} {'query':>5} {'context':>7} {'torch':>8} {'kernel':>8}"
          + (f" {'amx':>8} {'amx gain':>8}" if amx else f" {'speed-up':>8}"))
    for label, query, context, batch in STEPS:
        per_request = -(-(context + query) // BLOCK)
        num_blocks = batch * per_request + 1
        order = torch.randperm(num_blocks - 1, generator=gen) + 1
        tables = order.view(batch, per_request).tolist()
        caches = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                  for _ in range(layers)]
        q = torch.randn(batch * query, HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(batch * query, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        meta = build_attention_metadata([query] * batch, [context] * batch, tables, BLOCK,
                                        num_blocks)
        t_torch = median_ms(partial(attend_all, caches, q, k, meta, None))
        t_kernel = median_ms(partial(attend_all, caches, q, k, meta, twin))
        row = {"step": label, "requests": batch, "query": query, "context": context,
               "torch_ms": t_torch, "kernel_ms": t_kernel, "speedup": t_torch / t_kernel}
        line = (f"{label:>7} {batch:>8} {query:>5} {context:>7} {t_torch:>8.2f} "
                f"{t_kernel:>8.2f}")
        if amx is not None:
            t_amx = median_ms(partial(attend_all, caches, q, k, meta, amx))
            row |= {"amx_ms": t_amx, "amx_gain": t_kernel / t_amx}
            line += f" {t_amx:>8.2f} {t_kernel / t_amx:>7.2f}x"
        else:
            line += f" {t_torch / t_kernel:>7.2f}x"
        rows.append(row)
        print(line, flush=True)
    return rows


def interleaved_median_ms(fns: list, budget_ms: float = 9000.0) -> list[float]:  # type: ignore[type-arg]
    """Each fn's median single call, calls taken in turn (3 to 25 rounds, within the budget),
    so that a neighbour's load on the machine weighs on every variant alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    while len(times[0]) < 3 or (len(times[0]) < 25 and sum(map(sum, times)) < budget_ms):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(spent) for spent in times]


FP8_STEPS = [("decode", 1, 180, 64), ("decode", 1, 2000, 1), ("prefill", 512, 0, 1)]


def bench_fp8_cache(level: CpuLevel, layers: int) -> list[dict]:  # type: ignore[type-arg]
    """The attention kernel over a cache in the compute dtype and in each float8 format, in
    bfloat16 and float32 compute: ms per step (all layers), medians, and fp8 / plain."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"fp8 KV cache, {layers} layers, ms per step (medians)")
    print(f"{'step':>7} {'requests':>8} {'query':>5} {'context':>7} {'compute':>8} "
          f"{'plain':>8} {'e4m3':>8} {'e5m2':>8} {'e4m3/pl':>7} {'e5m2/pl':>7}")
    for label, query, context, batch in FP8_STEPS:
        per_request = -(-(context + query) // BLOCK)
        num_blocks = batch * per_request + 1
        tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, per_request)
        meta = build_attention_metadata([query] * batch, [context] * batch, tables.tolist(),
                                        BLOCK, num_blocks, torch_path=False)
        values = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
                  for _ in range(layers)]
        for dtype in (torch.bfloat16, torch.float32):
            q = torch.randn(batch * query, HEADS, HEAD_DIM, generator=gen).to(dtype)
            k = torch.randn(batch * query, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            runs = []
            for kv_dtype in (dtype, *FP8_DTYPES):
                kernel = paged_attention_kernel(level, HEAD_DIM, HEADS // KV_HEADS, dtype,
                                                kv_dtype)
                if kernel is None:
                    raise SystemExit(f"the attention kernel did not build for {kv_dtype}")
                caches = [v.to(kv_dtype) for v in values]
                runs.append(partial(attend_all, caches, q, k, meta, kernel))
            plain, e4m3, e5m2 = interleaved_median_ms(runs)
            name = str(dtype).removeprefix("torch.")
            rows.append({"step": label, "requests": batch, "query": query, "context": context,
                         "compute": name, "plain_ms": plain, "e4m3_ms": e4m3, "e5m2_ms": e5m2})
            print(f"{label:>7} {batch:>8} {query:>5} {context:>7} {name:>8} {plain:>8.2f} "
                  f"{e4m3:>8.2f} {e5m2:>8.2f} {e4m3 / plain:>6.2f}x {e5m2 / plain:>6.2f}x",
                  flush=True)
    return rows


# (name, out_features, in_features) of SmolLM2's matmuls
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]


def apply_all(linears: list[Linear], x: torch.Tensor) -> None:
    for linear in linears:
        linear(x)


def bench_matmul(kernels: LayerKernels, dtype: torch.dtype, layers: int) -> list[dict]:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(0)
    torch_only = LayerKernels(kernels.level)      # oneDNN (bf16 where it runs) or F.linear
    rows = []
    print(f"matmuls, {dtype}, GFLOP/s (torch / kernel), {layers} distinct weights each")
    print(f"{'rows':>5} " + " ".join(f"{name:>15}" for name, _, _ in SHAPES))
    for m in (1, 8, 64, 128, 512, 2048):
        cells = []
        for name, n, k in SHAPES:
            count = 2 if name == "lm_head" else layers
            weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(count)]
            x = torch.randn(m, k, generator=gen).to(dtype)
            mine = [Linear([w], kernels=kernels) for w in weights]
            theirs = [Linear([w], kernels=torch_only) for w in weights]
            repeats = max(2, int(2e10 // (2 * m * n * k * count)))
            flops = 2 * m * n * k * count / 1e6   # per step, in MFLOP: /ms = GFLOP/s
            t_torch = time_per_step(partial(apply_all, theirs, x), repeats)
            t_kernel = time_per_step(partial(apply_all, mine, x), repeats)
            rows.append({"rows": m, "shape": name, "torch_gflops": flops / t_torch,
                         "kernel_gflops": flops / t_kernel})
            cells.append(f"{flops / t_torch:6.1f} / {flops / t_kernel:6.1f}")
        print(f"{m:>5} " + " ".join(f"{c:>15}" for c in cells), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--level", default=None, help="CPU level (default: the best detected)")
    p.add_argument("--only", choices=["attention", "fp8", "matmul"], default=None)
    p.add_argument("--threads", type=int, default=None, help="default: torch's")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    level = CpuLevel.parse(a.level or "") or detect_level()
    kernels = load_cpu_kernels(level, HEAD_DIM, HEADS // KV_HEADS, dtype)
    print(f"{cpu_model()}, level {level.label}, {torch.get_num_threads()} threads")
    result: dict = {"cpu": cpu_model(), "level": level.label, "dtype": a.dtype,  # type: ignore[type-arg]
                    "layers": a.layers}
    if a.only in (None, "attention"):
        if kernels.attention is None:
            raise SystemExit("the attention kernel did not build here (see the warning above)")
        result["attention"] = bench_attention(kernels.attention, dtype, a.layers)
    if a.only in (None, "fp8"):
        result["fp8_cache"] = bench_fp8_cache(level, a.layers)
    if a.only in (None, "matmul"):
        result["matmul"] = bench_matmul(kernels, dtype, a.layers)
    write_result(result, a.out, "cpu-kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
