"""How often steady decode calls kvcache_svc (issue 37: at most one plan in 4 steps): the
engine's scheduler with kvcache_svc's real block manager in-process, 64 and 256 requests
admitted and prefilled, then decoding together; plan calls are counted over the steps until
the first request ends (a count, not a time)."""

import random

import numpy as np
import pytest

from tests.scheduler_svc.engine.common import add, applied, make_scheduler, sample

BLOCK_SIZE = 16


@pytest.mark.parametrize("num_requests", [64, 256])
def test_steady_decode_plans_at_most_once_in_four_steps(num_requests: int) -> None:
    rng = random.Random(num_requests)
    sched, kv = make_scheduler(num_blocks=num_requests * 24, max_num_seqs=num_requests,
                               max_num_batched_tokens=8192, block_size=BLOCK_SIZE,
                               max_model_len=1024, compact_decodes=True)
    for i in range(num_requests):
        add(sched, f"r{i}", [rng.randint(10, 500) for _ in range(rng.randint(20, 200))],
            max_tokens=128, ignore_eos=True)
    steps = plans = rows = 0
    steady = False
    while True:
        plan = sched.schedule()
        step = sched.apply_plan(applied(kv, plan))
        assert step is not None
        if steady:
            steps += 1
            plans += plan is not None
            assert not step.new_requests
        ids = [r.request_id for r in step.new_requests] + [r.request_id for r in step.running]
        sampled = {rid: 100 for rid in ids
                   if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
        num_rows = 0 if step.decodes is None else len(step.decodes.slots) // 4
        if steady:
            rows += num_rows
        output = sample(step, sampled)
        output.decode_token_ids = np.full(num_rows, 100, "<i4").tobytes()
        outputs = sched.update(output)
        if any(out.finish_reason is not None for out in outputs):
            break
        steady = not sched.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
    assert steps > 100
    # Steady decode travels as compact rows but for the steps that give a request a block.
    assert rows >= 0.9 * steps * num_requests
    assert plans / steps <= 0.25, (plans, steps)
