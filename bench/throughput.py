"""Throughput on the shared workload: splitserve (all services, over gRPC) against HF
transformers, same prompts, same dtype, in one invocation.

    .venv/bin/python bench/throughput.py [--dtype bfloat16] [--skip-hf] [--out FILE]

Workload (shared/bench/WORKLOAD): 64 chat prompts, greedy, exactly 128 new tokens each (EOS
ignored), all submitted at once; single stream = prompt 0. Each system gets an untimed warm-up.
Prints output tokens/s for both and the ratios; writes a JSON result to bench/results/.

The batch client is one asyncio event loop (grpc.aio), as a load generator should be: it shares
the machine's cores with the services, and 64 threads blocking on sync streams cost about twice
its CPU time (0.9-1.2 against 0.4-0.6 CPU-seconds per run, measured).
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.launcher import ClusterSpec, ServiceProcesses  # noqa: E402
from services.model_config import default_model_path  # noqa: E402
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402


def load_workload() -> tuple[list[str], str, int]:
    for candidate in (ROOT.parent / "shared" / "bench", ROOT / "shared" / "bench"):
        if (candidate / "workload.py").is_file():
            sys.path.insert(0, str(candidate))
            import workload  # type: ignore[import-not-found]

            return workload.PROMPTS, workload.SINGLE_PROMPT, workload.MAX_NEW_TOKENS
    raise SystemExit("shared/bench/workload.py not found beside the repository")


def write_result(results: dict, out: str | None, stem: str) -> None:  # type: ignore[type-arg]
    """Writes the JSON result to `out`, or to bench/results/<stem>-<time>.json."""
    path = Path(out) if out else ROOT / "bench" / "results" / \
        f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(prompt: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text=prompt, sampling=generation_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def run_stream(stub: generation_pb2_grpc.GenerationStub, prompt: str, max_tokens: int,
               ) -> tuple[int, float, float]:
    """(tokens, seconds to first token, seconds in all)."""
    start = time.perf_counter()
    first = None
    n = 0
    for chunk in stub.Generate(request(prompt, max_tokens), timeout=1800):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
        n += len(chunk.token_ids)
    return n, first or 0.0, time.perf_counter() - start


def run_batch(address: str, prompts: list[str], max_tokens: int) -> list[int]:
    """Every prompt streamed at once from one event loop; the tokens each got."""
    import grpc

    async def stream_all() -> list[int]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(prompt: str) -> int:
                n = 0
                async for chunk in stub.Generate(request(prompt, max_tokens), timeout=1800):
                    n += len(chunk.token_ids)
                return n

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(stream_all())


def bench_splitserve(prompts: list[str], single: str, max_tokens: int, dtype: str,
                     extra_args: list[str], worker_args: list[str], pp: int = 1,
                     tp: int = 1) -> dict[str, float]:
    import grpc

    port = free_port()
    spec = ClusterSpec(port=port, kv_plan_port=free_port(), kv_admin_port=free_port(),
                       kv_events_port=free_port(), metrics_port=-1,
                       dtype=dtype, tp=tp, pp=pp, scheduler_args=tuple(extra_args),
                       worker_args=tuple(worker_args),
                       log_level="warning")
    log_dir = Path(tempfile.mkdtemp(prefix="splitserve-bench-"))
    procs = ServiceProcesses(spec, log_dir)
    procs.start()
    try:
        procs.wait_ready(300)
        with grpc.insecure_channel(procs.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            # Warm-up: a batch and a single stream, untimed.
            run_batch(procs.address, prompts[:8], 16)
            run_stream(stub, single, 16)

            gaps = ForwardGaps(stub)
            n, ttft, total = run_stream(stub, single, max_tokens)
            single_decode = (n - 1) / (total - ttft)
            single_gap = gaps.mean_since_last()
            start = time.perf_counter()
            counts = run_batch(procs.address, prompts, max_tokens)
            wall = time.perf_counter() - start
            batch_gap = gaps.mean_since_last()
            assert sum(counts) == len(prompts) * max_tokens, counts
    finally:
        procs.stop()
    return {"batch_tok_s": sum(counts) / wall, "batch_wall_s": wall,
            "single_ttft_ms": ttft * 1000, "single_decode_tok_s": single_decode,
            "single_forward_gap_ms": single_gap, "batch_forward_gap_ms": batch_gap}


class ForwardGaps:
    """Mean idle time between the workers' forward passes over an interval, from the
    scheduler's ServerInfo counters (summed over replicas)."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub) -> None:
        self.stub = stub
        self.last = self._totals()

    def _totals(self) -> tuple[float, int]:
        info = self.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)
        return (sum(r.forward_gap_ms_total for r in info.replicas),
                sum(r.num_forward_gaps for r in info.replicas))

    def mean_since_last(self) -> float:
        now = self._totals()
        total, count = now[0] - self.last[0], now[1] - self.last[1]
        self.last = now
        return total / count if count else 0.0


def bench_hf(prompts: list[str], single: str, max_tokens: int, dtype: str,
             ) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch_dtype).eval()

    def generate(texts: list[str], n: int) -> tuple[int, float]:
        enc = tok(texts, return_tensors="pt", padding=True)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(texts), \
            time.perf_counter() - start

    generate(prompts[:8], 8)                 # warm-up
    _, ttft = generate([single], 1)
    n, total = generate([single], max_tokens)
    single_decode = (n - 1) / (total - ttft)
    count, wall = generate(prompts, max_tokens)
    return {"batch_tok_s": count / wall, "batch_wall_s": wall, "single_ttft_ms": ttft * 1000,
            "single_decode_tok_s": single_decode}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-dense", action="store_true",
                   help="bf16: skip the run without the int4 small-step kernel")
    p.add_argument("--scheduler-arg", action="append", default=[],
                   help="extra scheduler flag (repeatable), e.g. "
                   "--scheduler-arg=--no-prefix-caching")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompts, single, max_tokens = load_workload()
    prompts = prompts[:a.num_prompts]
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))

    results: dict[str, object] = {"dtype": a.dtype, "num_prompts": len(prompts),
                                  "max_tokens": max_tokens, "cpus": os.cpu_count()}
    ours = bench_splitserve(prompts, single, max_tokens, a.dtype, a.scheduler_arg, [])
    results["splitserve"] = ours
    rows = [("splitserve", ours)]
    if a.dtype == "bfloat16" and not a.skip_dense:
        # The same engine with every matmul on dense bf16 weights (no 4-bit kernel for small
        # steps): the strict same-dtype comparison.
        dense = bench_splitserve(prompts, single, max_tokens, a.dtype, a.scheduler_arg,
                                 ["--no-int4-kernels"])
        results["splitserve_dense_bf16"] = dense
        rows.append(("splitserve dense", dense))
    if not a.skip_hf:
        hf = bench_hf(prompts, single, max_tokens, a.dtype)
        results["hf_transformers"] = hf
        rows.append(("hf transformers", hf))
        results["ratio_batch"] = ours["batch_tok_s"] / hf["batch_tok_s"]
        results["ratio_single_decode"] = ours["single_decode_tok_s"] / hf["single_decode_tok_s"]
        if "splitserve_dense_bf16" in results:
            dense_r = results["splitserve_dense_bf16"]
            assert isinstance(dense_r, dict)
            results["ratio_batch_dense"] = dense_r["batch_tok_s"] / hf["batch_tok_s"]
            results["ratio_single_decode_dense"] = (dense_r["single_decode_tok_s"]
                                                    / hf["single_decode_tok_s"])

    print(f"\nshared workload, {a.dtype}, {len(prompts)} prompts x {max_tokens} tokens")
    print(f"{'system':<18}{'all at once tok/s':>18}{'single decode tok/s':>21}"
          f"{'single TTFT ms':>16}")
    for name, r in rows:
        print(f"{name:<18}{r['batch_tok_s']:>18.1f}{r['single_decode_tok_s']:>21.1f}"
              f"{r['single_ttft_ms']:>16.0f}")
    if "ratio_batch" in results:
        for name, r in rows[:-1]:
            hf_r = results["hf_transformers"]
            print(f"ratio {name} / HF: batch {r['batch_tok_s'] / hf_r['batch_tok_s']:.2f}x, "
                  f"single decode {r['single_decode_tok_s'] / hf_r['single_decode_tok_s']:.2f}x")
    write_result(results, a.out, f"throughput-{a.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
