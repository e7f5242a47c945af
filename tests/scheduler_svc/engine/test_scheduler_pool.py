"""The scheduler and the KV pool: preemption (never of a request with a step in flight),
requests longer than the pool, how often steady decode plans, commits of full blocks, growing
ahead only while the pool has room, and a pool kvcache_svc lost. Plans go to kvcache_svc's
real block manager in-process (tests/scheduler_svc/engine/common.py)."""

import random

import numpy as np
import pytest

from scheduler_svc.engine.request import RequestStatus
from tests.scheduler_svc.engine.common import (
    add,
    applied,
    make_scheduler,
    sample,
    scheduled,
    step,
)

BLOCK_SIZE = 16


def test_preempting_a_request_with_a_step_in_flight_is_refused() -> None:
    # A step in flight writes the request's blocks, and its output will decrement the
    # counters; resetting them instead would drive them negative when it comes back.
    sched, kv = make_scheduler()
    a = add(sched, "a", list(range(10, 20)), max_tokens=3)
    step(sched, kv)
    assert (a.num_in_flight, a.num_pending_tokens) == (1, 1)
    with pytest.raises(RuntimeError, match="request a preempted with 1 step in flight"):
        a.reset_for_preemption()


def test_preempt_all_forgets_the_steps_it_drops() -> None:
    # preempt_all drops its record of the steps in flight: what they hold of each request's
    # counters goes with them, or the request resumes looking in flight forever (it would
    # never be scheduled again, or never sample).
    sched, kv = make_scheduler()
    a = add(sched, "a", list(range(10, 20)), max_tokens=3)
    lost = step(sched, kv)
    sched.preempt_all()
    assert (a.num_in_flight, a.num_pending_tokens) == (0, 0)
    kv = make_scheduler()[1]                     # kvcache_svc's new pool
    s = step(sched, kv)
    assert s is not None and scheduled(s) == {"a": 10}
    assert sched.update(sample(lost, {"a": 5})) == []    # a late output of a dropped step
    (out,) = sched.update(sample(s, {"a": 7}))
    assert out.new_token_ids == [7] and a.output_token_ids == [7]


def test_a_request_longer_than_the_pool_is_refused() -> None:
    # 4 usable blocks of 4 tokens: the pool holds 16 tokens. A request needing more would be
    # admitted, grow until the pool is full, preempt itself and start over, forever.
    sched, _ = make_scheduler(num_blocks=5)
    add(sched, "fits", list(range(10)), max_tokens=6)
    with pytest.raises(ValueError, match="prompt .10 tokens. \\+ max_tokens .7. needs 17 "
                                         "tokens of KV cache; this replica's pool holds 16 "
                                         "tokens"):
        add(sched, "long", list(range(10)), max_tokens=7)
    assert "long" not in sched.requests and [r.request_id for r in sched.waiting] == ["fits"]


def test_full_blocks_are_committed_by_a_later_plan_and_before_a_free() -> None:
    sched, kv = make_scheduler(num_blocks=400, block_size=4)
    a = add(sched, "a", list(range(10, 22)), max_tokens=6)      # 12 prompt tokens
    s = step(sched, kv)
    assert a.num_committed_blocks == 3                          # the admission's full blocks
    plans = []
    while a.status is not RequestStatus.FINISHED:
        (out,) = sched.update(sample(s, {"a": 7}))
        if out.finish_reason is None:
            plans.append(sched.schedule())
            s = sched.apply_plan(applied(kv, plans[-1]))
    # The first decode needs a block: its plan grows the request ahead, to its last token;
    # the rest run on those blocks. 17 tokens computed (the last sampled one never is):
    # block 3 filled at 16 and waited for a plan, as one new full block does.
    assert plans[0] is not None and plans[0].grows[0].num_tokens == 18
    assert plans[1:] == [None] * 4
    assert kv.requests["a"].num_committed_blocks == 3
    # The free's plan commits it first.
    plan = sched.schedule()
    assert plan is not None and plan.free_ids == ["a"]
    [commit] = plan.commits
    assert commit.request_id == "a" and commit.new_block_hashes == a.block_hashes[3:4]
    sched.apply_plan(kv.apply(plan))
    # Another request with that prefix finds the 4 blocks cached.
    b = add(sched, "b", a.token_ids[:16] + [99], max_tokens=1)
    step(sched, kv)
    assert b.num_cached_tokens == 16


def test_a_pool_under_pressure_grows_no_block_ahead() -> None:
    # 15 usable blocks of 4 tokens, two requests needing 6 each at the end: growing ahead
    # would leave less than an eighth of the pool free, so each grow takes what its step
    # needs, and nothing is preempted.
    sched, kv = make_scheduler(num_blocks=16, block_size=4)
    for i in range(2):
        add(sched, f"r{i}", list(range(10 + i, 18 + i)), max_tokens=14)
    s = step(sched, kv)
    while sched.requests:
        outs = sched.update(sample(s, {r.request_id: 7 for r in [*s.new_requests,
                                                                   *s.running]}))
        assert all(o.error is None for o in outs)
        s = step(sched, kv)
        if s is None:
            break
    assert sched.num_preemptions == 0


def test_a_lost_pool_forgets_the_commits_and_frees_it_held() -> None:
    # kvcache_svc restarted: the new pool knows none of the old requests. A commit or free
    # still pending for one of them would be refused as a whole (before: the engine crashed
    # on "commit of unknown request" and its replica went down).
    sched, kv = make_scheduler(num_blocks=400, block_size=4)
    add(sched, "a", list(range(10, 22)), max_tokens=6)
    add(sched, "b", list(range(30, 42)), max_tokens=30)
    s = step(sched, kv)
    while "a" in sched.requests:
        sched.update(sample(s, {r.request_id: 7 for r in [*s.new_requests, *s.running]}))
        if "a" in sched.requests:
            s = step(sched, kv)
    assert sched.plans.commits and sched.plans.free_ids   # a's, waiting for a plan
    sched.preempt_all()
    new_kv = type(kv)(400, 4, True)                        # the restarted kvcache_svc's pool
    s = sched.apply_plan(applied(new_kv, sched.schedule()))
    assert s is not None and [r.request_id for r in s.new_requests] == ["b"]


@pytest.mark.parametrize("num_requests", [64, 256])
def test_steady_decode_plans_at_most_once_in_four_steps(num_requests: int) -> None:
    """Issue 37: kvcache_svc is called when blocks or admissions change; a plan grows each
    request ahead, so steady decode runs most steps on the blocks it holds. 64 and 256
    requests admitted and prefilled, then decoding together; plan calls counted until the
    first request ends (a count, not a time)."""
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
    # What the scheduler believes of every table is what kvcache_svc holds.
    for rid, request in sched.requests.items():
        assert request.block_ids == kv.requests[rid].block_ids()
