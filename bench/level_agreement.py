"""Do two CPU levels give the same greedy outputs in bfloat16? The shared workload on the real
services, one cluster per level, side by side.

    .venv/bin/python bench/level_agreement.py [--levels amx,avx512_bf16] [--num-prompts 64]

bfloat16 rounds every weight and activation, and each level sums its products in another order
(oneDNN's AMX tiles, VDPBF16PS in our kernels, float32 FMA), so two levels may pick different
tokens where the model's two best candidates are nearly tied; after such a step the outputs go
separate ways. The check: every prompt's tokens agree up to its first difference, and at that
step the reference level's (the first listed) two best tokens were within `--tie-nats` of each
other. Prints the prompts that agree in full, the mean share of tokens up to the first
difference, and the reference's largest margin at a difference; writes JSON to bench/results/.
"""

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import load_workload, write_result  # noqa: E402
from splitserve_runs import free_port  # noqa: E402

from services.launcher import ClusterSpec, ServiceProcesses  # noqa: E402
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from worker_svc.kernels.cpu import cpu_model  # noqa: E402

Output = list[tuple[int, float]]    # per token: (id, top-1 minus top-2 logprob)


async def _generate_all(address: str, prompts: list[str], max_tokens: int) -> list[Output]:
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt: str) -> Output:
            reply = await stub.GenerateOnce(generation_pb2.GenerateRequest(
                text=prompt, sampling=generation_pb2.SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)),
                timeout=1800)
            return [(lp.token_id, lp.top[0].logprob - lp.top[1].logprob)
                    for lp in reply.logprobs]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def run_level(level: str, prompts: list[str], max_tokens: int) -> list[Output]:
    spec = ClusterSpec(port=free_port(), kv_plan_port=free_port(), kv_admin_port=free_port(),
                       kv_events_port=free_port(), kv_store_port=free_port(), metrics_port=-1,
                       control_port=free_port(),
                       dtype="bfloat16", worker_args=("--cpu-level", level),
                       log_level="warning")
    log_dir = Path(tempfile.mkdtemp(prefix=f"splitserve-levels-{level}-"))
    procs = ServiceProcesses(spec, log_dir)
    procs.start()
    try:
        procs.wait_ready(300)
        return asyncio.run(_generate_all(procs.address, prompts, max_tokens))
    finally:
        procs.stop()


def compare(reference: list[Output], other: list[Output], tie_nats: float) -> dict[str, object]:
    agree_fully, shares, margins = 0, [], []
    for ref, got in zip(reference, other, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a[0] != b[0]),
                     None)
        if first is None:
            agree_fully += 1
            shares.append(1.0)
        else:
            shares.append(first / len(ref))
            margins.append(ref[first][1])
    worst = max(margins, default=0.0)
    return {"prompts": len(reference), "agree_fully": agree_fully,
            "mean_share_before_first_difference": sum(shares) / len(shares),
            "reference_margins_at_differences": margins,
            "largest_margin_at_a_difference": worst, "tie_nats": tie_nats,
            "within_tolerance": worst <= tie_nats}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="amx,avx512_bf16",
                   help="comma-separated CPU levels; the first is the reference")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--tie-nats", type=float, default=0.5,
                   help="the largest top-1/top-2 logprob gap at which a difference is allowed")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompts, _, max_tokens = load_workload()
    prompts = prompts[:a.num_prompts]
    levels = a.levels.split(",")
    outputs = {level: run_level(level, prompts, max_tokens) for level in levels}
    result: dict[str, object] = {"cpu": cpu_model(), "dtype": "bfloat16", "levels": levels,
                                 "max_tokens": max_tokens}
    ok = True
    for level in levels[1:]:
        r = compare(outputs[levels[0]], outputs[level], a.tie_nats)
        result[level] = r
        ok = ok and bool(r["within_tolerance"])
        print(f"{level} against {levels[0]}: {r['agree_fully']}/{r['prompts']} prompts agree in "
              f"full; {100 * r['mean_share_before_first_difference']:.1f} % of tokens before "  # type: ignore[operator]
              f"the first difference; largest reference margin at a difference "
              f"{r['largest_margin_at_a_difference']:.3f} nats (tolerance {a.tie_nats})")
    write_result(result, a.out, "level-agreement")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
