"""Parallel configurations on the shared workload, in one run: pp=1, pp=2 with the batch
queue, pp=2 with one batch at a time, tp=2, pp=1 with async scheduling.

    .venv/bin/python bench/parallel.py [--dtype bfloat16] [--num-prompts 64]

Every configuration runs the same prompts over gRPC through all services (see throughput.py)
and the table shows tokens/s and the ratio to pp=1. Every worker process gets
cores / workers threads, so on a small machine tp=2 and pp=2 split the same cores: pp gains
by overlapping stages, tp only pays its all-reduces (two per layer).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import bench_splitserve, load_workload, write_result  # noqa: E402

CONFIGS = [  # name, tp, pp, scheduler flags (synchronous steps but where named)
    ("pp=1", 1, 1, ["--no-async-scheduling"]),
    ("pp=2, batch queue", 1, 2, []),
    ("pp=2, one batch at a time", 1, 2, ["--max-batches-in-flight", "1"]),
    ("tp=2", 2, 1, ["--no-async-scheduling"]),
    ("pp=1, async scheduling", 1, 1, ["--async-scheduling"]),   # the default with pp=1
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--only", action="append", default=[],
                   help="run only configurations whose name starts with this (repeatable)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompts, single, max_tokens = load_workload()
    prompts = prompts[:a.num_prompts]
    results: dict[str, dict[str, float]] = {}
    for name, tp, pp, args in CONFIGS:
        if a.only and name != "pp=1" and not any(name.startswith(o) for o in a.only):
            continue
        results[name] = bench_splitserve(prompts, single, max_tokens, a.dtype, args, [],
                                         pp=pp, tp=tp)
        print(f"{name}: {results[name]['batch_tok_s']:.1f} tok/s", flush=True)
    base = results["pp=1"]["batch_tok_s"]
    print(f"\nshared workload, {a.dtype}, {len(prompts)} prompts x {max_tokens} tokens")
    print(f"{'configuration':<28}{'all at once tok/s':>18}{'vs pp=1':>9}{'single decode':>15}"
          f"{'gap single/batch ms':>21}")
    for name, r in results.items():
        gaps = f"{r['single_forward_gap_ms']:.2f} / {r['batch_forward_gap_ms']:.2f}"
        print(f"{name:<28}{r['batch_tok_s']:>18.1f}{r['batch_tok_s'] / base:>8.2f}x"
              f"{r['single_decode_tok_s']:>15.1f}{gaps:>21}")
    print("gap: the last stage's idle time between forward passes, mean per step (prepare "
          "included), single stream / all at once")
    write_result(results, a.out, f"parallel-{a.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
