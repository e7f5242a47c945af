"""Throughput on the shared workload: splitserve (all services, over gRPC) against HF
transformers and, with --with-vllm, vLLM's CPU build; same prompts, same weights, one invocation.

    .venv/bin/python bench/throughput.py [--dtype bfloat16] [--repeats 3] [--skip-hf]
                                         [--skip-dense] [--with-vllm [--vllm-dtype D ...]]
                                         [--batch-api stream|once|both]
                                         [--num-prompts N] [--out FILE]
    bash bench/vllm_env.sh     # once, before --with-vllm: vLLM's CPU build in .venv-vllm/
    python3 bench/throughput.py --device cuda [--shapes smollm2,llama-1b | --model DIR]
                                [--tokenizer DIR] [--skip-compile] [--repeats 3]

--device cuda (a GPU machine; scripts/gpu-check --bench runs it there) measures random-weight
models in the SmolLM2-135M and Llama-3.2-1B shapes: splitserve with its worker on the GPU,
then HF transformers on the same GPU, eager and with a static cache + torch.compile, and
splitserve's GPU idle share between steps; it prints a table per shape beside issue 13's
targets. bench/gpu_throughput.py holds that run; what follows describes the CPU run.

Workload (shared/bench/WORKLOAD): 64 chat prompts, greedy, exactly 128 new tokens each (EOS
ignored), all submitted at once; single stream = prompt 0. Each system gets an untimed warm-up.
The systems take turns, one round each, `--repeats` rounds (splitserve on a fresh cluster every
round); prints the CPU (model, vector flags) and each figure's median, the ratios of the medians
and the batch ratio of every round; writes a JSON result (medians and every round) to
bench/results/. --num-prompts below 64 is a quick smoke check, not the workload.

How splitserve's batch client asks (`--batch-api`, both by default, each on its own fresh
cluster every round): "splitserve" streams every completion (Generate: one message per token,
as a chat client reads them); "splitserve once" takes each completion in one reply
(GenerateOnce), as HF's generate() and vLLM's offline LLM.generate() return theirs: the peers'
own terms. The ratios are given for both.

vLLM runs in its own environment, driven through bench/vllm_peer.py: one driver per vLLM dtype,
loaded (and compiled, a few minutes) once before the first round, on the GGUF's weights saved
dequantized as an HF directory under bench/results/. Its dtype defaults to --dtype, plus
float32 when --dtype is bfloat16 and the CPU has no native bf16 (no avx512_bf16 or amx_bf16),
where vLLM's bf16 can be the slower; the ratios to vLLM take, for each figure, vLLM's faster
dtype.

splitserve's side (cluster start, warm-up, the asyncio batch client, the gap metric) is in
bench/splitserve_runs.py.
"""

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# bench_splitserve, load_workload and write_result are imported from here by parallel.py and
# cpu_kernels.py too.
from bench_io import load_workload, medians, time_peer_round, write_result  # noqa: E402
from splitserve_runs import BATCH_APIS, batch_apis, bench_splitserve  # noqa: E402
from vllm_peer import VllmPeer, save_hf_dir  # noqa: E402

from services.model_config import default_model_path  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
# JSON keys of the systems whose key is not their name with underscores.
RESULT_KEYS = {"splitserve dense": "splitserve_dense_bf16"}


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


def cpu_line(cpu: dict[str, object]) -> str:
    """`cpu_info` in one line, the first a bench prints."""
    return (f"cpu: {cpu['model']} (family/model {cpu['family_model']}), {cpu['cpus']} cpus, "
            + ", ".join(f"{f} {'yes' if cpu[f] else 'no'}" for f in CPU_FLAGS))


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
        return time_peer_round(self._generate, prompts, single, max_tokens)


def start_vllm(dtypes: list[str], kv_cache_dtype: str = "auto") -> dict[str, VllmPeer]:
    """One loaded vLLM driver per dtype, on the GGUF's weights saved as an HF directory, with
    vLLM's `kv_cache_dtype`."""
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"{VLLM_PYTHON} missing: run `bash bench/vllm_env.sh` first")
    gguf = default_model_path()
    model_dir = save_hf_dir(gguf, ROOT / "bench" / "results" / f"hf-{gguf.stem}")
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-peer-"))
    peers: dict[str, VllmPeer] = {}
    try:
        for dtype in dtypes:
            print(f"starting vLLM {dtype} (first start compiles; log in {log_dir})", flush=True)
            peers[dtype] = VllmPeer(VLLM_PYTHON, model_dir, dtype, log_dir, kv_cache_dtype)
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
    for name, suffix in (("splitserve", ""), ("splitserve once", "_once"),
                         ("splitserve dense", "_dense")):
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: random-weight models per --shapes on the GPU, splitserve and HF "
                   "transformers eager and static-cache compiled (bench/gpu_throughput.py)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                   help="float16: --device cuda only")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="fewer than 64: a quick smoke check, not the shared workload")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of every system; the table shows medians")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-dense", action="store_true",
                   help="CPU: skip the run without the small-step kernel on quantized blocks")
    p.add_argument("--batch-api", choices=["stream", "once", "both"], default=None,
                   help="splitserve's batch client streams (Generate), takes whole replies "
                   "(GenerateOnce, as the peers' offline APIs), or runs both (the default on a "
                   "CPU; stream on a GPU)")
    p.add_argument("--with-vllm", action="store_true",
                   help="CPU: also run vLLM's CPU build (bash bench/vllm_env.sh first)")
    p.add_argument("--vllm-dtype", action="append", choices=["float32", "bfloat16"],
                   help="vLLM dtype (repeatable, implies --with-vllm); default --dtype, plus "
                   "float32 for bfloat16 on a CPU without native bf16")
    p.add_argument("--vllm-kv-cache-dtype", default="auto",
                   choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="vLLM's --kv-cache-dtype (its CPU build takes fp8 with AVX-512 or "
                   "AMX); pass ours with --scheduler-arg=--kv-cache-dtype=fp8")
    p.add_argument("--scheduler-arg", action="append", default=[],
                   help="extra scheduler flag (repeatable), e.g. "
                   "--scheduler-arg=--no-prefix-caching")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra worker flag (repeatable), e.g. --worker-arg=--enforce-eager")
    gpu = p.add_argument_group("--device cuda")
    gpu.add_argument("--shapes", default="smollm2,llama-1b",
                     help="comma-separated random-weight shapes (scripts/random_model.py)")
    gpu.add_argument("--model", default=None, metavar="DIR",
                     help="run this HF directory instead of building --shapes")
    gpu.add_argument("--models-dir", default=str(ROOT / "models" / "random"),
                     help="where the random models are built, DIR/<shape>, and reused")
    gpu.add_argument("--tokenizer", default=None, metavar="PATH",
                     help="tokenizer for the random models (a directory from "
                     "`scripts/random_model.py --export-tokenizer`); default: the GGUF's")
    gpu.add_argument("--skip-compile", action="store_true",
                     help="skip HF static cache + torch.compile (its compile takes minutes)")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    if a.device == "cuda":
        if a.with_vllm or a.vllm_dtype:
            p.error("--with-vllm drives vLLM's CPU build: --device cpu only")
        from gpu_throughput import check_shapes, run_cuda

        try:
            shapes = check_shapes(a.shapes, a.model)
        except ValueError as exc:
            p.error(str(exc))
        prompts, single, max_tokens = load_workload()
        return run_cuda(a, shapes, prompts[:a.num_prompts], single, max_tokens)
    if a.dtype == "float16":
        p.error("--dtype float16 is for --device cuda (the CPU workers refuse it)")
    return run_cpu(a)


def run_cpu(a: argparse.Namespace) -> int:
    """The shared workload on this machine's CPU, against HF transformers and vLLM."""
    cpu = cpu_info()
    print(cpu_line(cpu), flush=True)
    prompts, single, max_tokens = load_workload()
    prompts = prompts[:a.num_prompts]
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
    # Explicit, so that a GPU in this machine (and a worker default of auto) changes nothing.
    worker_args = ["--device", "cpu", *a.worker_arg]

    # Every system runs once per round, in turn, so slow and fast spells of this shared
    # machine fall on all of them; splitserve gets a fresh cluster every time (a cold prefix
    # cache, as on the first round).
    systems: dict[str, Callable[[], dict[str, float]]] = {
        BATCH_APIS[api]: lambda api=api: bench_splitserve(
            prompts, single, max_tokens, a.dtype, a.scheduler_arg, worker_args, batch_api=api)
        for api in batch_apis(a.batch_api or "both")}
    if a.dtype == "bfloat16" and not a.skip_dense:
        # The same engine with every matmul on dense bf16 weights (no 4-bit kernel for small
        # steps): the strict same-dtype comparison.
        systems["splitserve dense"] = lambda: bench_splitserve(
            prompts, single, max_tokens, a.dtype, a.scheduler_arg,
            [*worker_args, "--no-quant-kernels"])
    if not a.skip_hf:
        hf = HfBaseline(a.dtype)
        systems["hf transformers"] = lambda: hf.run(prompts, single, max_tokens)
    vllm: dict[str, VllmPeer] = {}
    if a.with_vllm or a.vllm_dtype:
        native_bf16 = cpu["avx512_bf16"] or cpu["amx_bf16"]
        dtypes = a.vllm_dtype or [a.dtype] + (
            ["float32"] if a.dtype == "bfloat16" and not native_bf16 else [])
        vllm = start_vllm(list(dict.fromkeys(dtypes)), a.vllm_kv_cache_dtype)
        kv = "" if a.vllm_kv_cache_dtype == "auto" else f" kv {a.vllm_kv_cache_dtype}"
        for dtype, peer in vllm.items():
            systems[f"vllm {dtype}{kv}"] = lambda peer=peer: peer.run(prompts, single,
                                                                      max_tokens)
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
                                  "cpu": cpu, "repeats": a.repeats,
                                  "scheduler_args": a.scheduler_arg,
                                  "worker_args": a.worker_arg,
                                  "vllm_kv_cache_dtype": a.vllm_kv_cache_dtype}
    table = {name: medians(r) for name, r in runs.items()}
    for name in table:
        results[RESULT_KEYS.get(name, name.replace(" ", "_"))] = table[name]
    if vllm:
        results["vllm"] = {"version": next(iter(vllm.values())).version,
                           "start_s": {d: peer.start_s for d, peer in vllm.items()}}

    print(f"\nshared workload, {a.dtype}, {len(prompts)} prompts x {max_tokens} tokens, "
          f"median of {a.repeats} round(s); cpu: {cpu['model']}; splitserve flags: "
          f"{' '.join(a.scheduler_arg + a.worker_arg) or 'defaults'}")
    print(f"{'system':<18}{'all at once tok/s':>18}{'single decode tok/s':>21}"
          f"{'single TTFT ms':>16}")
    for name, r in table.items():
        print(f"{name:<18}{r['batch_tok_s']:>18.1f}{r['single_decode_tok_s']:>21.1f}"
              f"{r['single_ttft_ms']:>16.0f}")
    for name, r in table.items():
        if "batch_cpu_s" in r:     # splitserve: what the split's own processes cost
            cpu_s: dict[str, float] = r["batch_cpu_s"]  # type: ignore[assignment]
            split = sum(v for k, v in cpu_s.items() if not k.startswith("worker"))
            print(f"{name}: CPU seconds in the batch run: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in cpu_s.items())
                  + f"; the split's own share (all but the workers) "
                    f"{100 * split / sum(cpu_s.values()):.1f} %; workers idle between "
                    f"forwards {100 * r['batch_idle_fraction']:.1f} % of the wall time; "
                    f"decode step with every request in the batch "
                    f"{r['batch_decode_step_ms']:.1f} ms")
    if "hf transformers" in table:
        add_ratios(results, table, runs, ["hf transformers"], "")
    if vllm:
        add_ratios(results, table, runs, [n for n in table if n.startswith("vllm ")], "_vllm")
    write_result(results, a.out, f"throughput-{a.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
