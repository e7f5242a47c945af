"""Throughput on the shared workload: splitserve (all services, over gRPC) against HF
transformers and, with --with-vllm, vLLM's CPU build; same prompts, same weights, one invocation.

    .venv/bin/python bench/throughput.py [--dtype bfloat16] [--repeats 3] [--skip-hf]
                                         [--skip-dense] [--with-vllm [--vllm-dtype D ...]]
                                         [--num-prompts N] [--out FILE]
    bash bench/vllm_env.sh     # once, before --with-vllm: vLLM's CPU build in .venv-vllm/

Workload (shared/bench/WORKLOAD): 64 chat prompts, greedy, exactly 128 new tokens each (EOS
ignored), all submitted at once; single stream = prompt 0. Each system gets an untimed warm-up.
The systems take turns, one round each, `--repeats` rounds (splitserve on a fresh cluster every
round); prints the CPU (model, vector flags) and each figure's median, the ratios of the medians
and the batch ratio of every round; writes a JSON result (medians and every round) to
bench/results/. --num-prompts below 64 is a quick smoke check, not the workload.

vLLM runs in its own environment, driven through bench/vllm_peer.py: one driver per vLLM dtype,
loaded (and compiled, a few minutes) once before the first round, on the GGUF's weights saved
dequantized as an HF directory under bench/results/. Its dtype defaults to --dtype, plus
float32 when --dtype is bfloat16 and the CPU has no native bf16 (no avx512_bf16 or amx_bf16),
where vLLM's bf16 can be the slower; the ratios to vLLM take, for each figure, vLLM's faster
dtype.

The batch client is one asyncio event loop (grpc.aio), as a load generator should be: it shares
the machine's cores with the services, and 64 threads blocking on sync streams cost about twice
its CPU time (0.9-1.2 against 0.4-0.6 CPU-seconds per run, measured).
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.launcher import ClusterSpec, ServiceProcesses  # noqa: E402
from services.model_config import default_model_path  # noqa: E402
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from vllm_peer import VllmPeer, save_hf_dir  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
# JSON keys of the systems whose key is not their name with underscores.
RESULT_KEYS = {"splitserve dense": "splitserve_dense_bf16"}


def load_workload() -> tuple[list[str], str, int]:
    for candidate in (ROOT.parent / "shared" / "bench", ROOT / "shared" / "bench"):
        if (candidate / "workload.py").is_file():
            sys.path.insert(0, str(candidate))
            import workload  # type: ignore[import-not-found]

            return workload.PROMPTS, workload.SINGLE_PROMPT, workload.MAX_NEW_TOKENS
    raise SystemExit("shared/bench/workload.py not found beside the repository")


def cpu_info() -> dict[str, object]:
    """Model name, core count and the vector flags every figure depends on. Family and model
    number too: a VM may name the CPU only "AMD EPYC" (family 23 is Zen 2, 25 Zen 3/4)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
        if key.strip() == "flags":
            break  # the first processor's block is enough
    flags = set(info.get("flags", "").split())
    return {"model": info.get("model name", "unknown"),
            "family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
            "cpus": os.cpu_count(), **{f: f in flags for f in CPU_FLAGS}}


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


class HfBaseline:
    """HF transformers on the same GGUF weights, loaded once; `run()` times one repeat (the
    first call also warms up, untimed)."""

    def __init__(self, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = default_model_path()
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch_dtype).eval()
        self.warm = False

    def _generate(self, texts: list[str], n: int) -> tuple[int, float]:
        import torch

        enc = self.tok(texts, return_tensors="pt", padding=True)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=self.tok.pad_token_id)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(texts), \
            time.perf_counter() - start

    def run(self, prompts: list[str], single: str, max_tokens: int) -> dict[str, float]:
        if not self.warm:
            self._generate(prompts[:8], 8)
            self.warm = True
        _, ttft = self._generate([single], 1)
        n, total = self._generate([single], max_tokens)
        single_decode = (n - 1) / (total - ttft)
        count, wall = self._generate(prompts, max_tokens)
        return {"batch_tok_s": count / wall, "batch_wall_s": wall,
                "single_ttft_ms": ttft * 1000, "single_decode_tok_s": single_decode}


def medians(runs: list[dict[str, float]]) -> dict[str, object]:
    """Each figure's median over the repeats, plus the repeats themselves."""
    return {**{key: statistics.median(r[key] for r in runs) for key in runs[0]}, "runs": runs}


def start_vllm(dtypes: list[str]) -> dict[str, VllmPeer]:
    """One loaded vLLM driver per dtype, on the GGUF's weights saved as an HF directory."""
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"{VLLM_PYTHON} missing: run `bash bench/vllm_env.sh` first")
    gguf = default_model_path()
    model_dir = save_hf_dir(gguf, ROOT / "bench" / "results" / f"hf-{gguf.stem}")
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-peer-"))
    peers: dict[str, VllmPeer] = {}
    try:
        for dtype in dtypes:
            print(f"starting vLLM {dtype} (first start compiles; log in {log_dir})", flush=True)
            peers[dtype] = VllmPeer(VLLM_PYTHON, model_dir, dtype, log_dir)
            print(f"vLLM {peers[dtype].version} {dtype} ready in "
                  f"{peers[dtype].start_s:.0f} s", flush=True)
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    return peers


def add_ratios(results: dict[str, object], table: dict[str, dict[str, object]],
               runs: dict[str, list[dict[str, float]]], peers: list[str], prefix: str) -> None:
    """Each splitserve variant against the strongest of `peers`, figure by figure: the ratio of
    the medians, and the batch ratio of every round."""
    def median(name: str, key: str) -> float:
        return table[name][key]  # type: ignore[return-value]

    batch_ref = max(peers, key=lambda n: median(n, "batch_tok_s"))
    decode_ref = max(peers, key=lambda n: median(n, "single_decode_tok_s"))
    results[f"ratio{prefix}_against"] = {"batch": batch_ref, "single_decode": decode_ref}
    for name, suffix in (("splitserve", ""), ("splitserve dense", "_dense")):
        if name not in table:
            continue
        batch = median(name, "batch_tok_s") / median(batch_ref, "batch_tok_s")
        decode = median(name, "single_decode_tok_s") / median(decode_ref, "single_decode_tok_s")
        rounds = [o["batch_tok_s"] / r["batch_tok_s"]
                  for o, r in zip(runs[name], runs[batch_ref])]
        results[f"ratio{prefix}_batch{suffix}"] = batch
        results[f"ratio{prefix}_single_decode{suffix}"] = decode
        results[f"ratio{prefix}_batch{suffix}_per_round"] = rounds
        print(f"ratio {name} / {batch_ref}: batch {batch:.2f}x "
              f"(rounds: {', '.join(f'{x:.2f}' for x in rounds)}); "
              f"single decode / {decode_ref}: {decode:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="fewer than 64: a quick smoke check, not the shared workload")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of every system in turn; the table shows medians")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-dense", action="store_true",
                   help="skip the run without the small-step kernel on quantized blocks")
    p.add_argument("--with-vllm", action="store_true",
                   help="also run vLLM's CPU build (bash bench/vllm_env.sh first)")
    p.add_argument("--vllm-dtype", action="append", choices=["float32", "bfloat16"],
                   help="vLLM dtype (repeatable, implies --with-vllm); default --dtype, plus "
                   "float32 for bfloat16 on a CPU without native bf16")
    p.add_argument("--scheduler-arg", action="append", default=[],
                   help="extra scheduler flag (repeatable), e.g. "
                   "--scheduler-arg=--no-prefix-caching")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    cpu = cpu_info()
    print(f"cpu: {cpu['model']} (family/model {cpu['family_model']}), {cpu['cpus']} cpus, "
          + ", ".join(f"{f} {'yes' if cpu[f] else 'no'}" for f in CPU_FLAGS), flush=True)
    prompts, single, max_tokens = load_workload()
    prompts = prompts[:a.num_prompts]
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))

    # Every system runs once per round, in turn, so slow and fast spells of this shared
    # machine fall on all of them; splitserve gets a fresh cluster every time (a cold prefix
    # cache, as on the first round).
    systems: dict[str, Callable[[], dict[str, float]]] = {
        "splitserve": lambda: bench_splitserve(prompts, single, max_tokens, a.dtype,
                                               a.scheduler_arg, [])}
    if a.dtype == "bfloat16" and not a.skip_dense:
        # The same engine with every matmul on dense bf16 weights (no 4-bit kernel for small
        # steps): the strict same-dtype comparison.
        systems["splitserve dense"] = lambda: bench_splitserve(
            prompts, single, max_tokens, a.dtype, a.scheduler_arg, ["--no-quant-kernels"])
    if not a.skip_hf:
        hf = HfBaseline(a.dtype)
        systems["hf transformers"] = lambda: hf.run(prompts, single, max_tokens)
    vllm: dict[str, VllmPeer] = {}
    if a.with_vllm or a.vllm_dtype:
        native_bf16 = cpu["avx512_bf16"] or cpu["amx_bf16"]
        dtypes = a.vllm_dtype or [a.dtype] + (
            ["float32"] if a.dtype == "bfloat16" and not native_bf16 else [])
        vllm = start_vllm(list(dict.fromkeys(dtypes)))
        for dtype, peer in vllm.items():
            systems[f"vllm {dtype}"] = lambda peer=peer: peer.run(prompts, single, max_tokens)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    try:
        for round_no in range(1, a.repeats + 1):
            for name, run in systems.items():
                runs[name].append(run())
                print(f"round {round_no}/{a.repeats} {name}: "
                      f"{runs[name][-1]['batch_tok_s']:.1f} tok/s all at once", flush=True)
    finally:
        for peer in vllm.values():
            peer.close()

    results: dict[str, object] = {"dtype": a.dtype, "num_prompts": len(prompts),
                                  "max_tokens": max_tokens, "cpus": os.cpu_count(),
                                  "cpu": cpu, "repeats": a.repeats}
    table = {name: medians(r) for name, r in runs.items()}
    for name in table:
        results[RESULT_KEYS.get(name, name.replace(" ", "_"))] = table[name]
    if vllm:
        results["vllm"] = {"version": next(iter(vllm.values())).version,
                           "start_s": {d: peer.start_s for d, peer in vllm.items()}}

    print(f"\nshared workload, {a.dtype}, {len(prompts)} prompts x {max_tokens} tokens, "
          f"median of {a.repeats} round(s); cpu: {cpu['model']}")
    print(f"{'system':<18}{'all at once tok/s':>18}{'single decode tok/s':>21}"
          f"{'single TTFT ms':>16}")
    for name, r in table.items():
        print(f"{name:<18}{r['batch_tok_s']:>18.1f}{r['single_decode_tok_s']:>21.1f}"
              f"{r['single_ttft_ms']:>16.0f}")
    if "hf transformers" in table:
        add_ratios(results, table, runs, ["hf transformers"], "")
    if vllm:
        add_ratios(results, table, runs, [f"vllm {d}" for d in vllm], "_vllm")
    write_result(results, a.out, f"throughput-{a.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
