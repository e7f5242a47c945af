"""The cluster's host ceiling: tokens/s and CPU per generated token of every process when the
model costs nothing (the null worker, `python -m worker_svc --null-model`), beside the same
cluster on a real tiny model and vLLM's CPU engine on that model (issue 37).

    .venv/bin/python bench/host_ceiling.py [--null-step-ms 0 1.92] [--prompts 64 256]
                                           [--batch-api stream|once|both] [--client-procs 4]
                                           [--rounds N] [--skip-real] [--with-vllm] [--quick]
                                           [--out FILE]
    bash bench/vllm_env.sh     # once, before --with-vllm

Model: a tiny random Llama built on the fly (scripts/random_family.py: 2 layers, hidden 128,
4 heads of 32, the smallest vLLM's CPU attention takes; SmolLM2's tokenizer and vocabulary).
Workload: the shared one (64 chat prompts, greedy, exactly 128 new tokens each, EOS ignored);
256 prompts are the 64 four times over (prefix-cache hits included, for every system alike).

Runs, each on a fresh cluster (float32, --max-num-seqs the prompt count) after an untimed
warm-up: for every null step time (`--null-step-ms`: the emulated device's milliseconds per
step, worker_svc.null_runner; 0 = the host's ceiling, 1.92 at 64 rows stands in for an H100),
every prompt count and every batch API ("stream": Generate, a message per token; "once":
GenerateOnce, whole replies), the null worker; then the real tiny model (the normal CPU
worker) at the same counts and APIs; with --with-vllm, vLLM's offline engine on the same model
directory at the same counts (whole completions; its ratio is taken against both APIs).

Each cluster runs `--rounds` timed runs (default 1): tok/s is the median run's, CPU per token,
plans per step and the idle share are over them all. The timed client is `--client-procs`
processes (splitserve_runs.BatchClients), each with its own gRPC channel and its share of the
prompts, all started together; wall time runs from the first request to the last token. Per
run: output tok/s; CPU microseconds per generated token of every process of the cluster, the
launcher's services and all their descendants, found in /proc and labelled by command line
(bench/process_tree.py), and of the clients together; plans per step (kvcache_svc's admin
`Stats.num_plans` over ServerInfo's engine steps; steady decode alone is counted by
tests/scheduler_svc/engine/test_scheduler_pool.py); and the idle share: the workers' summed gaps
between forwards (ServerInfo, splitserve_runs.ForwardGaps) over the wall time (with the null
worker: the emulated device's idle time). CPU time, not wall time, is the robust figure on a
shared machine. The JSON result goes to bench/results/.

--quick: 16 prompts x 16 tokens, 2 client processes (unless given), one API: a smoke check.
"""

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import load_workload, write_result  # noqa: E402
from process_tree import TreeCpu, cpu_used  # noqa: E402
from splitserve_runs import BatchClients, ForwardGaps, batch_apis, free_port, run_batch  # noqa: E402
from throughput import VLLM_PYTHON, cpu_info, cpu_line  # noqa: E402
from vllm_peer import MAX_MODEL_LEN, VllmPeer  # noqa: E402

from scripts.random_family import build_family_model  # noqa: E402
from services.cluster_token import call_metadata  # noqa: E402
from services.launcher import ClusterSpec, ServiceProcesses  # noqa: E402
from services.rpc.splitserve.v1 import (  # noqa: E402
    generation_pb2_grpc,
    kvcache_pb2,
    kvcache_pb2_grpc,
)
from services.wire import IDLE_GAP_S  # noqa: E402

# The tiny model's shape beyond random_family's defaults; its context is vllm_peer's.
MODEL_SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "intermediate_size": 256,
               "max_position_embeddings": MAX_MODEL_LEN}
VOCAB_SIZE = 49152           # SmolLM2's
QUICK_PROMPTS, QUICK_TOKENS, QUICK_CLIENTS = 16, 16, 2
WARMUP_PROMPTS, WARMUP_TOKENS = 8, 16


@dataclass
class Run:
    """One timed run's figures."""

    system: str                        # "null X ms", "real model" or "vllm"
    num_prompts: int
    api: str                           # "stream", "once" (vLLM: "offline")
    tok_s: float                       # generated tokens / wall seconds
    wall_s: float                      # first request to last token
    cpu_us_per_token: dict[str, float]  # by cluster process (bench/process_tree.py labels)
    client_us_per_token: float         # the client processes together
    plans_per_step: float              # kvcache_svc plan calls per engine step
    idle_share: float                  # workers' gaps between forwards / wall time

    @property
    def cluster_us_per_token(self) -> float:
        return sum(self.cpu_us_per_token.values())


def build_model(out_dir: Path) -> Path:
    build_family_model(out_dir, "llama", vocab_size=VOCAB_SIZE, tokenizer=True, **MODEL_SHAPE)
    return out_dir


def workload(num_prompts: int, base: list[str]) -> list[str]:
    """The shared prompts, repeated as often as `num_prompts` needs."""
    return (base * -(-num_prompts // len(base)))[:num_prompts]


def time_cluster(model: Path, system: str, worker_args: list[str], prompts: list[str],
                 max_tokens: int, api: str, num_clients: int, rounds: int = 1) -> Run:
    """One fresh cluster, warmed up, then `rounds` timed runs (module docstring): tok/s of the
    median run; CPU per token, plans per step and the idle share over them all."""
    import grpc

    spec = ClusterSpec(model=str(model), port=free_port(), control_port=free_port(),
                       kv_plan_port=free_port(), kv_admin_port=free_port(),
                       kv_events_port=free_port(), kv_store_port=free_port(), metrics_port=-1,
                       dtype="float32", log_level="warning",
                       scheduler_args=("--max-num-seqs", str(len(prompts))),
                       worker_args=("--device", "cpu", *worker_args))
    log_dir = Path(tempfile.mkdtemp(prefix="host-ceiling-"))
    procs = ServiceProcesses(spec, log_dir)
    procs.start()
    try:
        try:
            procs.wait_ready(300)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; service logs in {log_dir}") from exc
        with grpc.insecure_channel(procs.address) as channel, \
                grpc.insecure_channel(f"127.0.0.1:{spec.kv_admin_port}") as admin_channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            admin = kvcache_pb2_grpc.KvCacheAdminStub(admin_channel)

            def num_plans() -> int:
                return admin.Stats(kvcache_pb2.StatsRequest(), timeout=10,
                                   metadata=call_metadata(procs.cluster_token)).num_plans

            run_batch(procs.address, prompts[:WARMUP_PROMPTS], WARMUP_TOKENS)   # untimed
            counts, walls, client_cpu = [], [], 0.0
            tree = TreeCpu(p.pid for p in procs.procs.values())
            gap_ms = num_steps = plans = 0
            used: dict[str, float] = {}
            for _ in range(rounds):
                warm = time.monotonic()
                clients = BatchClients(procs.address, prompts, max_tokens, num_clients, api)
                # Idle past IDLE_GAP_S, or the pause since the last run counts as a gap.
                time.sleep(max(0.0, warm + IDLE_GAP_S + 0.1 - time.monotonic()))
                gaps, plans_before = ForwardGaps(stub), num_plans()
                before = tree.snapshot()
                round_counts, wall, round_client_cpu = clients.run()
                after = tree.snapshot()
                round_gap_ms, _, round_steps = gaps.since_last()
                plans += num_plans() - plans_before
                gap_ms += round_gap_ms
                num_steps += round_steps
                counts += round_counts
                walls.append(wall)
                client_cpu += round_client_cpu
                for label, cpu_s in cpu_used(before, after).items():
                    used[label] = used.get(label, 0.0) + cpu_s
    finally:
        procs.stop()
    tokens = sum(counts)
    if tokens != rounds * len(prompts) * max_tokens:
        raise RuntimeError(f"{system}: {tokens} tokens, expected {rounds} x {len(prompts)} x "
                           f"{max_tokens}")
    per_token = {label: cpu * 1e6 / tokens for label, cpu in used.items()}
    wall = statistics.median(walls)
    return Run(system, len(prompts), api, tokens / rounds / wall, wall, per_token,
               client_cpu * 1e6 / tokens, plans / num_steps if num_steps else 0.0,
               gap_ms / (sum(walls) * 1e3))


def time_vllm(model: Path, prompt_counts: list[int], base: list[str], max_tokens: int,
              ) -> tuple[list[Run], str]:
    """vLLM's offline engine on `model`, once per prompt count (batch only); its version."""
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"{VLLM_PYTHON} missing: run `bash bench/vllm_env.sh` first")
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-peer-"))
    print(f"starting vLLM float32 (first start compiles; log in {log_dir})", flush=True)
    peer = VllmPeer(VLLM_PYTHON, model, "float32", log_dir)
    print(f"vLLM {peer.version} ready in {peer.start_s:.0f} s", flush=True)
    runs = []
    try:
        for n in prompt_counts:
            prompts = workload(n, base)
            r = peer.run(prompts, prompts[0], max_tokens, batch_only=True)
            runs.append(Run("vllm", n, "offline", r["batch_tok_s"], r["batch_wall_s"], {},
                            0.0, 0.0, 0.0))
            print(row(runs[-1]), flush=True)
    finally:
        peer.close()
    return runs, peer.version


HEADER = (f"{'system':<14}{'prompts':>8} {'api':<8}{'tok/s':>9}{'wall s':>8}{'plans/step':>11}"
          f"{'idle %':>8}{'cluster us/tok':>15}{'clients us/tok':>15}")


def row(r: Run) -> str:
    cluster = f"{r.cluster_us_per_token:>15.1f}" if r.cpu_us_per_token else f"{'-':>15}"
    client = f"{r.client_us_per_token:>15.1f}" if r.cpu_us_per_token else f"{'-':>15}"
    plans = f"{r.plans_per_step:>11.2f}" if r.cpu_us_per_token else f"{'-':>11}"
    idle = f"{100 * r.idle_share:>8.1f}" if r.cpu_us_per_token else f"{'-':>8}"
    return (f"{r.system:<14}{r.num_prompts:>8} {r.api:<8}{r.tok_s:>9.0f}{r.wall_s:>8.2f}"
            f"{plans}{idle}{cluster}{client}")


def ratios(runs: list[Run]) -> dict[str, float]:
    """Each splitserve run's tok/s over vLLM's at the same prompt count, keyed
    "system, prompts, api"."""
    vllm = {r.num_prompts: r.tok_s for r in runs if r.system == "vllm"}
    return {f"{r.system}, {r.num_prompts}, {r.api}": r.tok_s / vllm[r.num_prompts]
            for r in runs if r.system != "vllm" and r.num_prompts in vllm}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--null-step-ms", type=float, nargs="+", default=[0.0],
                   help="the null worker's emulated device time per step (one cluster each)")
    p.add_argument("--prompts", type=int, nargs="+", default=None,
                   help="prompt counts, the shared 64 repeated as needed (default 64 256)")
    p.add_argument("--batch-api", choices=["stream", "once", "both"], default=None,
                   help="Generate (a message per token), GenerateOnce, or both (default)")
    p.add_argument("--client-procs", type=int, default=None,
                   help="client processes, each with its channel and share (default 4)")
    p.add_argument("--skip-real", action="store_true", help="no run on the real tiny model")
    p.add_argument("--with-vllm", action="store_true",
                   help="vLLM's CPU engine on the same model (bash bench/vllm_env.sh first)")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed runs per cluster (CPU per token over them all; tok/s of the "
                        "median run): more tokens make the /proc tick counts steadier")
    p.add_argument("--quick", action="store_true",
                   help="a smoke check: 16 prompts x 16 tokens, 2 clients, one API")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    base, _, max_tokens = load_workload()
    prompt_counts = a.prompts or ([QUICK_PROMPTS] if a.quick else [64, 256])
    apis = batch_apis(a.batch_api or ("stream" if a.quick else "both"))
    num_clients = a.client_procs or (QUICK_CLIENTS if a.quick else 4)
    max_tokens = QUICK_TOKENS if a.quick else max_tokens
    cpu = cpu_info()
    print(cpu_line(cpu), flush=True)
    model = build_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")) / "model")
    print(f"model: tiny random llama {MODEL_SHAPE}, vocab {VOCAB_SIZE}, 2 layers ({model}); "
          f"{max_tokens} new tokens per prompt, float32, {num_clients} client processes",
          flush=True)
    print(HEADER, flush=True)

    runs: list[Run] = []
    systems = [(f"null {x:g} ms", ["--null-model", "--null-step-ms", str(x)])
               for x in a.null_step_ms]
    systems += [] if a.skip_real else [("real model", [])]
    for system, worker_args in systems:
        for n in prompt_counts:
            for api in apis:
                runs.append(time_cluster(model, system, worker_args, workload(n, base),
                                         max_tokens, api, num_clients, a.rounds))
                print(row(runs[-1]), flush=True)
    vllm_version = None
    if a.with_vllm:
        vllm_runs, vllm_version = time_vllm(model, prompt_counts, base, max_tokens)
        runs += vllm_runs

    print(f"\n{len(prompt_counts)} prompt count(s) x {max_tokens} tokens; {cpu['model']}")
    print(HEADER)
    for r in runs:
        print(row(r))
    print("\nCPU us per generated token, by process:")
    for r in runs:
        if r.cpu_us_per_token:
            print(f"{r.system}, {r.num_prompts}, {r.api}: "
                  + ", ".join(f"{label} {us:.1f}" for label, us in r.cpu_us_per_token.items())
                  + f"; clients {r.client_us_per_token:.1f}")
    against = ratios(runs)
    if against:
        print("\nsplitserve / vLLM tok/s, at the same prompt count:")
        for system in dict.fromkeys(r.system for r in runs if r.system != "vllm"):
            print(f"  {system}: " + ", ".join(
                f"{key.split(', ', 1)[1].replace(', ', ' ')} {ratio:.2f}x"
                for key, ratio in against.items() if key.startswith(f"{system}, ")))
    write_result({"cpu": cpu, "model_shape": MODEL_SHAPE, "vocab_size": VOCAB_SIZE,
                  "max_tokens": max_tokens, "client_procs": num_clients, "rounds": a.rounds,
                  "vllm_version": vllm_version,
                  "runs": [{**asdict(r), "cluster_us_per_token": r.cluster_us_per_token}
                           for r in runs],
                  "ratio_to_vllm": against}, a.out, "host-ceiling")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
