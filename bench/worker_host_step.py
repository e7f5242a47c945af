"""The worker's host time per decode step, in one process (issue 37: <= 0.25 ms at 64 rows,
<= 0.4 at 256, with the attention metadata built).

    .venv/bin/python bench/worker_host_step.py [--rows 64 256] [--steps 100] [--rounds 3]
                                               [--out FILE]

The engine core's scheduler and kvcache_svc's block manager run in-process and make real
steps (StepInput diffs, compact decode rows, plans when blocks change) for `--rows` greedy
requests of ~110-126 prompt tokens (block size 16, prefix caching on); the null runner
(worker_svc.null_runner: the real input batch, block tables, metadata and input ids, no
compute) takes each. Timed per step: decoding the step's frame (MessagePack, validated), the
runner's whole step and encoding its StepOutput, what a worker's host does for a step on a GPU
but for the kernel launches. The scheduler's own time is not counted. Per round: the median
and 90th percentile over `--steps` decode steps after the prefill; rounds alternate row counts.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_io import write_result  # noqa: E402
from host_ceiling import build_model  # noqa: E402
from throughput import cpu_info, cpu_line  # noqa: E402

from kvcache_svc.block_manager import ReplicaBlockManager  # noqa: E402
from scheduler_svc.engine.config import SchedulerConfig  # noqa: E402
from scheduler_svc.engine.request import Request, SamplingParams  # noqa: E402
from scheduler_svc.engine.scheduler import Scheduler  # noqa: E402
from services.codec import Codec  # noqa: E402
from services.model_config import load_model_config  # noqa: E402
from services.wire import FromWorker, ToWorker  # noqa: E402
from worker_svc.null_runner import NullModelOptions, NullRunner  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 40_000


def decode_step_ms(model: Path, rows: int, num_steps: int) -> list[float]:
    """`num_steps` decode steps' worker host times (ms), after the prefill."""
    config = load_model_config(str(model))
    sched = Scheduler(SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=1 << 15,
                                      block_size=BLOCK_SIZE, max_model_len=1024))
    sched.set_capacity(NUM_BLOCKS)
    kv = ReplicaBlockManager(NUM_BLOCKS, BLOCK_SIZE, True)
    runner = NullRunner(config, torch.float32, "w", NullModelOptions())
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE, rows)
    for i in range(rows):
        prompt = [5 + (i * 7 + j) % 1000 for j in range(110 + i % 17)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=num_steps + 8, ignore_eos=True), (0,), 1024,
            BLOCK_SIZE, hash_blocks=True))
    to_worker, from_worker = Codec(ToWorker), Codec(FromWorker)
    times = []
    for k in range(num_steps + 1):
        plan = sched.schedule()
        step = sched.apply_plan(None if plan is None else kv.apply(plan))
        assert step is not None
        frame = to_worker.encode(step)
        start = time.perf_counter()
        output = runner.execute(to_worker.decode(frame))
        from_worker.encode(output)
        elapsed = time.perf_counter() - start
        if k:                                   # step 0 is the prefill
            times.append(elapsed * 1e3)
        sched.update(output)
    runner.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cpu = cpu_info()
    print(cpu_line(cpu))
    results: dict[str, object] = {"cpu": cpu, "steps": args.steps, "rounds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model")
        for r in range(args.rounds):
            for rows in args.rows:
                times = sorted(decode_step_ms(model, rows, args.steps))
                median = statistics.median(times)
                p90 = times[int(0.9 * (len(times) - 1))]
                print(f"round {r + 1}: {rows:4d} rows  worker host {median:.3f} ms/step "
                      f"median, {p90:.3f} p90", flush=True)
                results["rounds"].setdefault(str(rows), []).append(  # type: ignore[union-attr]
                    {"median_ms": median, "p90_ms": p90})
    write_result(results, args.out, "worker_host_step")


if __name__ == "__main__":
    main()
