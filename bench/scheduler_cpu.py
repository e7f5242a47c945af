"""The scheduler's own CPU per generated token: what bounds a large batch's tokens/s once the
workers are fast (on a GPU, issue 20), measured where the model costs nothing.

    python bench/scheduler_cpu.py [--stream-interval 1 4] [--once] [--rounds 3]

A tiny random Llama (hidden 64, two layers, SmolLM2's tokenizer and vocabulary; built on the
fly by scripts/random_family.py) runs the shared workload's 64 prompts at once through the real
services, float32, one cluster per --stream-interval value. Per round it reads the scheduler
process's CPU time per thread from /proc and prints microseconds per generated token: its
event loop (the main thread: the client streams over gRPC), and every other thread together
(the replicas' engine threads, tokenizing, ZMQ). CPU time, not wall time: robust on a noisy
machine. The event loop and the engine threads share one GIL, so their sum bounds the
scheduler at about 1e6 / (sum) tokens per second, whatever the workers' speed. `--once` adds a
cluster whose client takes each completion whole (GenerateOnce; one prompt streams as
splitserve_runs.run_batch's probe).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import load_workload  # noqa: E402
from splitserve_runs import free_port, run_batch  # noqa: E402

from scripts.random_family import build_family_model  # noqa: E402
from services.launcher import ClusterSpec, ServiceProcesses  # noqa: E402


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid`: "loop" for its main thread, "other" for the rest."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"loop": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue                       # the thread ended meanwhile
        out["loop" if int(tid) == pid else "other"] += (int(fields[11]) + int(fields[12])) / tick
    return out


def measure(model: Path, stream_interval: int, rounds: int, api: str = "stream",
            ) -> list[dict[str, float]]:
    prompts, _, max_tokens = load_workload()
    spec = ClusterSpec(model=str(model), port=free_port(), control_port=free_port(),
                       kv_plan_port=free_port(), kv_admin_port=free_port(),
                       kv_events_port=free_port(), kv_store_port=free_port(), metrics_port=-1,
                       dtype="float32", log_level="warning",
                       scheduler_args=("--stream-interval", str(stream_interval)))
    procs = ServiceProcesses(spec, Path(tempfile.mkdtemp(prefix="scheduler-cpu-")))
    procs.start()
    results = []
    try:
        procs.wait_ready(300)
        run_batch(procs.address, prompts[:8], 16)                 # warm-up, untimed
        pid = procs.procs["scheduler"].pid
        for _ in range(rounds):
            before = thread_cpu(pid)
            start = time.perf_counter()
            tokens = sum(run_batch(procs.address, prompts, max_tokens, api=api))
            wall = time.perf_counter() - start
            after = thread_cpu(pid)
            per = {k: (after[k] - before[k]) * 1e6 / tokens for k in after}
            results.append({"tok_s": tokens / wall, **per, "total": sum(per.values())})
    finally:
        procs.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream-interval", type=int, nargs="+", default=[1, 4])
    p.add_argument("--once", action="store_true",
                   help="also a client that takes whole replies (GenerateOnce)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = Path(tempfile.mkdtemp(prefix="tiny-llama-")) / "model"
    build_family_model(model, "llama", vocab_size=49152, tokenizer=True)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; scheduler CPU in us per generated token")
    runs = [(f"--stream-interval {n}", n, "stream") for n in args.stream_interval]
    runs += [("GenerateOnce", 1, "once")] if args.once else []
    for name, interval, api in runs:
        rounds = measure(model, interval, args.rounds, api)
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"{name}: event loop {med['loop']:.1f}, other threads "
              f"{med['other']:.1f}, total {med['total']:.1f} us/token (bound ~"
              f"{1e6 / med['total']:,.0f} tok/s); {med['tok_s']:.0f} tok/s here "
              f"(medians of {len(rounds)} rounds)", flush=True)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
