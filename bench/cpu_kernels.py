"""Decode attention: the C kernel (worker_svc/kernels) against the torch path, side by side.

    .venv/bin/python bench/cpu_kernels.py [--dtype bfloat16] [--layers 30]

(Not named kernels.py: transformers imports a top-level `kernels` module when one exists.)

SmolLM2's attention shape (9 query heads, 3 KV heads, head_dim 64), 16-token blocks scattered
over a cache per layer (so K/V come from memory, as in a real step, not from cache), for
several batch sizes and context lengths. Prints milliseconds per step (all layers) and the
ratio; writes a JSON result to bench/results/.
"""

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))
from throughput import write_result  # noqa: E402

from worker_svc.attention import (  # noqa: E402
    AttentionMetadata,
    build_attention_metadata,
    paged_attention,
)
from worker_svc.kernels import PagedAttentionKernel, paged_attention_kernel  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def attend_all(caches: list[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               meta: AttentionMetadata, kernel: PagedAttentionKernel | None) -> None:
    """One step's decode attention over every layer (k doubles as v)."""
    for cache in caches:
        paged_attention(q, k, k, cache, meta, kernel)


def time_per_step(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    kernel = paged_attention_kernel(HEAD_DIM, HEADS // KV_HEADS, dtype)
    if kernel is None:
        raise SystemExit("the C kernel did not build here (see the warning above)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"decode attention, {a.dtype}, {a.layers} layers, ms per step")
    print(f"{'batch':>5} {'context':>7} {'torch':>8} {'kernel':>8} {'speed-up':>8}")
    for batch, context in [(1, 180), (1, 2000), (16, 180), (64, 180), (64, 1000)]:
        per_request = -(-(context + 1) // BLOCK)
        num_blocks = batch * per_request + 1
        order = torch.randperm(num_blocks - 1, generator=gen) + 1
        tables = order.view(batch, per_request).tolist()
        caches = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                  for _ in range(a.layers)]
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        meta = build_attention_metadata([1] * batch, [context] * batch, tables, BLOCK,
                                        num_blocks)
        repeats = max(3, 2000 // (batch * a.layers))
        t_torch = time_per_step(partial(attend_all, caches, q, k, meta, None), repeats)
        t_kernel = time_per_step(partial(attend_all, caches, q, k, meta, kernel), repeats)
        rows.append({"batch": batch, "context": context, "torch_ms": t_torch,
                     "kernel_ms": t_kernel, "speedup": t_torch / t_kernel})
        print(f"{batch:>5} {context:>7} {t_torch:>8.2f} {t_kernel:>8.2f} "
              f"{t_torch / t_kernel:>7.2f}x")
    write_result({"dtype": a.dtype, "layers": a.layers, "rows": rows}, a.out, "cpu-kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
