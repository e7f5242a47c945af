"""The front door under the same client as vLLM's server (issue 38, point 4).

vLLM's OpenAI server (its CPU build, .venv-vllm) and splitserve's HTTP front end, started in
turn on the same weights, each driven by vLLM's own load generator (`vllm bench serve`,
bench/vllm_bench_serve.py) with the same prompts and settings in one invocation; then the
same prompts through splitserve's gRPC API (streamed, one client process) and through its
HTTP API with a lean client (bench/http_lean_client.py, one process, raw sockets), in turn on
the cluster that served HTTP, for the HTTP path's cost: the load generator costs ~850 µs of
CPU per token, which on 2 cores is a core taken from the server, so HTTP against gRPC is
taken with clients of like cost.

    bash bench/vllm_env.sh     # once
    .venv/bin/python bench/http_serving.py [--dtype bfloat16|float32] [--concurrency 64]
                                           [--num-prompts 64] [--rounds N] [--skip-vllm]
                                           [--out FILE]

Workload: the shared prompts (shared/bench/workload.py, already chat-formatted) on
/v1/completions, greedy, exactly 128 new tokens each (ignore_eos), streamed, at most
`--concurrency` requests in flight, all sent at once (request rate inf). The model is
SmolLM2-135M-Instruct from its GGUF, saved once as an HF directory (bench/vllm_peer.py):
vLLM loads that directory, splitserve the GGUF, both the same float weights.

Printed per system: output tok/s, TTFT and inter-token latency (p50, p99) as the load
generator measures them (its own definitions: TTFT from sending to the first content chunk,
ITL between content chunks), and the ratios: splitserve HTTP over vLLM's server, HTTP over
gRPC (tokens / wall time of the same prompts, each API with its lean client; and the load
generator's HTTP figure over gRPC's). With several rounds each figure is the median round's.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import load_workload, write_result  # noqa: E402
from http_lean_client import http_stream_process  # noqa: E402
from splitserve_runs import CLIENT_NICE, CpuUse, batch_client_process, free_port  # noqa: E402
from throughput import cpu_info, cpu_line  # noqa: E402
from vllm_peer import KV_CACHE_GIB, MAX_MODEL_LEN, save_hf_dir  # noqa: E402

from services.launcher import ClusterSpec, ServiceProcesses  # noqa: E402
from services.model_config import default_model_path  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BENCH_CLIENT = ROOT / "bench" / "vllm_bench_serve.py"
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
READY_TIMEOUT_S = 600.0


def wait_http(base_url: str, log: Path, timeout_s: float,
              proc: subprocess.Popen[bytes] | None = None) -> str:
    """Polls GET /v1/models until it answers (while `proc`, if given, lives); returns the
    served model's name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as resp:
                return str(json.load(resp)["data"][0]["id"])
        except (OSError, ValueError, KeyError, IndexError):
            time.sleep(1.0)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s; see {log}")


def load(base_url: str, model: str, tokenizer: Path, dataset: Path, num_prompts: int,
         concurrency: int, max_tokens: int, out_dir: Path, name: str) -> dict[str, float]:
    """One `vllm bench serve` run; its result JSON's figures (METRICS, and the counts)."""
    result = out_dir / f"{name}.json"
    cmd = [str(VLLM_PYTHON), str(BENCH_CLIENT), "--backend", "openai",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
           "--tokenizer", str(tokenizer), "--dataset-name", "custom",
           "--dataset-path", str(dataset), "--skip-chat-template", "--disable-shuffle",
           "--custom-output-len", str(max_tokens), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
           "--temperature", "0", "--percentile-metrics", "ttft,itl,tpot,e2el",
           "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", result.name]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out_dir / f"{name}.log", "w") as log:
        # At the gRPC batch client's niceness (splitserve_runs.CLIENT_NICE), for every
        # server alike: on 2 cores the load generator competes with the model's threads.
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                       preexec_fn=lambda: os.nice(CLIENT_NICE))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    raw = json.loads(result.read_text())
    if raw["completed"] != num_prompts:
        raise RuntimeError(f"{name}: {raw['completed']} of {num_prompts} requests completed; "
                           f"see {out_dir / (name + '.log')}")
    return {**{key: float(raw[key]) for key in (*METRICS, "completed", "total_output_tokens")},
            "client_cpu_s": client_cpu_s}


def run_vllm(model_dir: Path, dtype: str, a: argparse.Namespace, dataset: Path,
             out_dir: Path) -> list[dict[str, float]]:
    """vLLM's OpenAI server on `model_dir`: a warm-up, then `a.rounds` timed runs."""
    port = free_port()
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores,
           "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
    log = out_dir / "vllm-server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(model_dir), "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
             "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(a.concurrency)],
            stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        base_url = f"http://127.0.0.1:{port}"
        start = time.monotonic()
        model = wait_http(base_url, log, READY_TIMEOUT_S, proc)
        print(f"vLLM server ready in {time.monotonic() - start:.0f} s", flush=True)
        return timed_rounds(base_url, model, model_dir, dataset, a, out_dir, "vllm")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_splitserve(model_dir: Path, dtype: str, a: argparse.Namespace, dataset: Path,
                   prompts: list[str], out_dir: Path,
                   ) -> tuple[list[dict[str, float]], list[dict[str, object]],
                              list[dict[str, object]]]:
    """splitserve (`splitserve up`'s cluster with its HTTP front end) on the GGUF: HTTP
    rounds under the load generator, then as many rounds of the gRPC batch client and of the
    lean HTTP client (bench/http_lean_client.py) in turn, on the same cluster (tok/s); each
    with the CPU seconds every service's process tree used (`cpu_s`) and the client's."""
    http_port = free_port()
    spec = ClusterSpec(model=str(default_model_path()), port=free_port(),
                       control_port=free_port(), kv_plan_port=free_port(),
                       kv_admin_port=free_port(), kv_events_port=0, kv_store_port=0,
                       metrics_port=-1, http_port=http_port, dtype=dtype,
                       scheduler_args=("--max-num-seqs", str(a.concurrency)),
                       log_level="warning")
    procs = ServiceProcesses(spec, out_dir / "splitserve-logs")
    procs.start()
    try:
        procs.wait_ready(READY_TIMEOUT_S)
        base_url = f"http://127.0.0.1:{http_port}"
        model = wait_http(base_url, out_dir / "splitserve-logs", READY_TIMEOUT_S)
        http = timed_rounds(base_url, model, model_dir, dataset, a, out_dir, "splitserve",
                            procs)
        grpc_runs, lean_runs = [], []
        expected = len(prompts) * a.max_tokens
        for _ in range(a.rounds):       # alternating: the machine's speed drifts
            cpu = CpuUse(procs)
            counts, _, wall, client_cpu_s = batch_client_process(procs.address, prompts,
                                                                 a.max_tokens)
            grpc_runs.append({"output_throughput": sum(counts) / wall,
                              "cpu_s": cpu.since_start(), "client_cpu_s": client_cpu_s})
            cpu = CpuUse(procs)
            counts, wall, client_cpu_s = http_stream_process(base_url, model, prompts,
                                                             a.max_tokens, CLIENT_NICE)
            if sum(counts) != expected:
                raise RuntimeError(f"lean HTTP client: {sum(counts)} tokens, not {expected}")
            lean_runs.append({"output_throughput": sum(counts) / wall,
                              "cpu_s": cpu.since_start(), "client_cpu_s": client_cpu_s})
        return http, grpc_runs, lean_runs
    finally:
        procs.stop()


def timed_rounds(base_url: str, model: str, tokenizer: Path, dataset: Path,
                 a: argparse.Namespace, out_dir: Path, name: str,
                 procs: ServiceProcesses | None = None) -> list[dict[str, float]]:
    """An untimed warm-up (8 prompts, 16 tokens), then `a.rounds` timed runs; with `procs`,
    each run's CPU seconds per service (`cpu_s`)."""
    load(base_url, model, tokenizer, dataset, 8, 8, 16, out_dir, f"{name}-warmup")
    runs = []
    for i in range(a.rounds):
        cpu = CpuUse(procs) if procs is not None else None
        run = load(base_url, model, tokenizer, dataset, a.num_prompts, a.concurrency,
                   a.max_tokens, out_dir, f"{name}-{i}")
        if cpu is not None:
            run["cpu_s"] = cpu.since_start()  # type: ignore[assignment]
        runs.append(run)
    return runs


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median output throughput (its latencies belong to it)."""
    ranked = sorted(runs, key=lambda r: r["output_throughput"])
    return ranked[(len(ranked) - 1) // 2]


def row(name: str, r: dict[str, float]) -> str:
    return (f"{name:<18}{r['output_throughput']:>10.1f}{r['median_ttft_ms']:>10.1f}"
            f"{r['p99_ttft_ms']:>10.1f}{r['median_itl_ms']:>9.2f}{r['p99_itl_ms']:>9.2f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests per run (the shared prompts, repeated as needed)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per request (default the workload's, 128)")
    p.add_argument("--rounds", type=int, default=3, help="timed runs per system")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--out", help="result JSON (default bench/results/http-serving-<time>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    base, _, workload_tokens = load_workload()
    a.max_tokens = a.max_tokens or workload_tokens
    prompts = (base * -(-a.num_prompts // len(base)))[:a.num_prompts]
    cpu = cpu_info()
    print(cpu_line(cpu), flush=True)
    if not a.skip_vllm and not VLLM_PYTHON.is_file():
        raise SystemExit(f"{VLLM_PYTHON} missing: run `bash bench/vllm_env.sh` first")
    gguf = default_model_path()
    model_dir = save_hf_dir(gguf, ROOT / "bench" / "results" / f"hf-{gguf.stem}")
    out_dir = Path(tempfile.mkdtemp(prefix="http-serving-"))
    dataset = out_dir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{a.num_prompts} prompts x {a.max_tokens} tokens, {a.concurrency} concurrent, "
          f"{a.dtype}; logs and raw results in {out_dir}", flush=True)

    results: dict[str, object] = {"cpu": cpu, "args": vars(a)}
    http, grpc_runs, lean_runs = run_splitserve(model_dir, a.dtype, a, dataset, prompts,
                                                out_dir)
    results["splitserve_http"], results["splitserve_grpc"] = http, grpc_runs
    results["splitserve_http_lean"] = lean_runs
    if not a.skip_vllm:
        results["vllm_server"] = run_vllm(model_dir, a.dtype, a, dataset, out_dir)

    print(f"\n{'system':<18}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}   (ms)")
    ours = median_run(http)
    print(row("splitserve HTTP", ours))
    grpc_run = median_run(grpc_runs)  # type: ignore[arg-type]
    grpc = grpc_run["output_throughput"]
    print(f"{'splitserve gRPC':<18}{grpc:>10.1f}")
    lean_run = median_run(lean_runs)  # type: ignore[arg-type]
    lean = lean_run["output_throughput"]
    print(f"{'splitserve HTTP, lean client':<30}{lean:>10.1f}")
    print(f"HTTP / gRPC throughput: {lean / grpc:.3f} with clients of like cost (lean HTTP, "
          f"gRPC batch); {ours['output_throughput'] / grpc:.3f} with the load generator")
    results["http_over_grpc"] = {"lean_client": lean / grpc,
                                 "load_generator": ours["output_throughput"] / grpc}
    num_tokens = a.num_prompts * a.max_tokens
    for label, run in (("HTTP, load generator", ours), ("HTTP, lean client", lean_run),
                       ("gRPC", grpc_run)):
        parts = {**run["cpu_s"], "client": run["client_cpu_s"]}  # type: ignore[dict-item]
        print(f"CPU us per token, {label}: " + ", ".join(
            f"{k} {v / num_tokens * 1e6:.1f}" for k, v in parts.items()))
    if not a.skip_vllm:
        peer = median_run(results["vllm_server"])  # type: ignore[arg-type]
        print(row("vLLM server", peer))
        ratios = {key: ours[key] / peer[key] for key in METRICS}
        results["ratios_vs_vllm"] = ratios
        print("splitserve / vLLM: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    write_result(results, a.out, "http-serving")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
