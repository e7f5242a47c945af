"""The engine core's own scheduling work per generated token, in one process (issue 37).

    .venv/bin/python bench/engine_step.py [--rows 64 256] [--tokens 128] [--rounds 5]

The engine's `Scheduler` (scheduler_svc.engine.scheduler) against kvcache_svc's real block
manager in-process, with null step outputs: `rows` requests of 100-token random prompts, each
generating `tokens` tokens (ignore_eos), run to the end; every step is drafted, planned when
it must be, applied, answered (every sampled token 7, the decode rows' packed) and taken by
`update_packed` into a StepPacker whose messages are built. Printed per row count: the
median round's process CPU microseconds per generated token of the scheduler's work, and of
the block manager's plans apart. No sockets, no codec, no threads: what is left of the engine
core process's CPU per token (bench/host_ceiling.py) beyond this is its messaging.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache_svc.block_manager import ReplicaBlockManager  # noqa: E402
from scheduler_svc.engine.config import SchedulerConfig  # noqa: E402
from scheduler_svc.engine.outputs import StepPacker  # noqa: E402
from scheduler_svc.engine.request import Request, SamplingParams  # noqa: E402
from scheduler_svc.engine.scheduler import Scheduler  # noqa: E402
from services.wire import StepOutput, StepTimings  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 20000
PROMPT_TOKENS = 100


def one_round(rows: int, new_tokens: int, seed: int) -> tuple[float, float]:
    """(scheduler, block manager) CPU microseconds per generated token."""
    cfg = SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=8192, block_size=BLOCK_SIZE,
                          max_model_len=4096)
    sched = Scheduler(cfg)
    sched.set_capacity(NUM_BLOCKS)
    kv = ReplicaBlockManager(NUM_BLOCKS, BLOCK_SIZE, True, group_windows=cfg.kv_group_windows)
    rng = random.Random(seed)
    for i in range(rows):
        prompt = [rng.randint(10, 40000) for _ in range(PROMPT_TOKENS)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=new_tokens,
                                                                  ignore_eos=True),
                                  (2,), cfg.max_model_len, BLOCK_SIZE, True, handle=i))
    tokens, kv_s = 0, 0.0
    start = time.process_time()
    while sched.requests:
        plan = sched.schedule()
        kv_start = time.process_time()
        reply = None if plan is None else kv.apply(plan)
        kv_s += time.process_time() - kv_start
        step = sched.apply_plan(reply)
        if step is None:
            continue
        ids = [r.request_id for r in step.new_requests] + [r.request_id for r in step.running]
        num_rows = 0 if step.decodes is None else len(step.decodes.slots) // 4
        output = StepOutput(step_id=step.step_id, worker_id="w", request_ids=ids,
                            sampled_token_ids=[7] * len(ids), logprobs=[None] * len(ids),
                            timings=StepTimings(0.0, 0.0, 0.0, 0),
                            decode_token_ids=np.full(num_rows, 7, dtype="<i4").tobytes())
        packer = StepPacker()
        sched.update_packed(output, packer)
        packer.messages(0, 0)
        tokens += len(ids) + num_rows
    total = time.process_time() - start
    return (total - kv_s) * 1e6 / tokens, kv_s * 1e6 / tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    for rows in a.rows:
        runs = [one_round(rows, a.tokens, seed) for seed in range(a.rounds)]
        sched_us = statistics.median(r[0] for r in runs)
        kv_us = statistics.median(r[1] for r in runs)
        print(f"{rows:>4} rows: scheduler {sched_us:.2f} us/token, block manager's plans "
              f"{kv_us:.2f} us/token (median of {a.rounds} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
