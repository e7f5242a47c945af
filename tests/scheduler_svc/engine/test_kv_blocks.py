"""The scheduler over KV groups (scheduler_svc.engine.kv_blocks): per-group block tables that mirror
kvcache_svc's exactly (its sliding-group frees included), free-block estimates that count a
sliding group's blocks as bounded by its window, preemption that frees every group, and the
longest request a pool holds."""

import pytest

from scheduler_svc.engine.request import RequestStatus
from services.wire import StepInput
from tests.scheduler_svc.engine.common import add, applied, make_scheduler, sample, step

WINDOWS = (0, 8)            # one full group, one sliding group of 8 tokens; blocks of 4


def _tokens(step_input: StepInput) -> dict[str, int]:
    return {r.request_id: 7 for r in [*step_input.new_requests, *step_input.running]}


def test_tables_and_estimates_follow_kvcache_svc_through_prefill_and_decode() -> None:
    sched, kv = make_scheduler(num_blocks=200, kv_group_windows=WINDOWS,
                               max_num_batched_tokens=12)
    add(sched, "a", list(range(100, 140)), max_tokens=30)         # 40-token prompt
    add(sched, "b", list(range(200, 225)), max_tokens=30)
    num_steps, most_freed = 0, 0
    while sched.requests:
        plan = sched.schedule()
        assert plan is None or all(
            op.num_computed_tokens == sched.requests[op.request_id].num_computed_tokens
            for op in plan.grows)
        s = sched.apply_plan(None if plan is None else kv.apply(plan))
        if s is None:
            break
        for running in s.running:
            assert len(running.new_block_ids) == 2
        for rid, request in sched.requests.items():
            if rid not in kv.requests:                           # still waiting
                assert not request.block_ids
                continue
            state = kv.requests[rid]
            assert request.block_ids == state.block_ids()        # the frees mirrored
            assert request.num_freed_blocks == state.num_freed
            most_freed = max(most_freed, request.num_freed_blocks[1])
            assert request.num_freed_blocks[0] == 0
            assert request.num_held_blocks == sum(1 for ids in state.block_ids() for b in ids
                                                  if b)
        sched.update(sample(s, _tokens(s)))
        num_steps += 1
    assert num_steps > 10
    assert most_freed >= 10          # the sliding group gave blocks back as a request went
    step(sched, kv)
    assert kv.stats().num_used_blocks == 0


def test_the_estimate_counts_what_a_sliding_grow_gives_back() -> None:
    sched, kv = make_scheduler(num_blocks=200, kv_group_windows=WINDOWS)
    add(sched, "a", list(range(100, 132)), max_tokens=20)
    s = step(sched, kv)
    sched.update(sample(s, {"a": 7}))
    num_plans = 0
    for _ in range(16):
        plan = sched.schedule()
        request = sched.requests["a"]
        if plan is None:                 # a step on the blocks grown ahead: nothing changes
            before = kv.pool.num_free_blocks
            s = sched.apply_plan(None)
            assert kv.pool.num_free_blocks == before
        else:
            num_plans += 1
            [grow] = plan.grows
            # The grow reaches ahead of the step: its cost, frees included, is exact.
            cost = sched.kv_blocks.grow_cost(request,
                                             grow.num_tokens - request.num_computed_tokens)
            before = kv.pool.num_free_blocks
            s = sched.apply_plan(kv.apply(plan))
            assert before - kv.pool.num_free_blocks == cost
        sched.update(sample(s, {"a": 7}))
    assert 2 <= num_plans <= 16 // 4


def test_a_small_pool_preempts_and_every_request_finishes() -> None:
    # 24 usable blocks: one 30-token request takes 8 in the full group and at most 5 in the
    # sliding one; three at once do not fit, so some are preempted and recomputed.
    sched, kv = make_scheduler(num_blocks=25, kv_group_windows=WINDOWS,
                               max_num_batched_tokens=8)
    for i in range(3):
        add(sched, f"r{i}", list(range(100 + 40 * i, 120 + 40 * i)), max_tokens=10)
    finished = 0
    for _ in range(500):
        s = step(sched, kv)
        if s is None:
            if not sched.requests:
                break
            continue
        outs = sched.update(sample(s, {r: 7 for r in _sampling(sched, s)}))
        finished += sum(o.finish_reason is not None for o in outs)
        for request in sched.running:
            assert request.status is RequestStatus.RUNNING
    assert finished == 3 and sched.num_preemptions > 0
    sched.apply_plan(applied(kv, sched.schedule()))
    assert kv.stats().num_used_blocks == 0 and kv.stats().num_requests == 0


def _sampling(sched, s: StepInput) -> list[str]:  # type: ignore[no-untyped-def]
    ids = [r.request_id for r in [*s.new_requests, *s.running]]
    return [rid for rid in ids if rid in sched.requests
            and sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]


@pytest.mark.parametrize("windows,expected", [((0,), 96), ((0, 0), 48), ((0, 8), 76),
                                              ((8,), 1 << 40)])
def test_the_longest_request_counts_every_group(windows: tuple[int, ...],
                                                expected: int) -> None:
    # 24 usable blocks of 4 tokens, steps of up to 8 tokens: a sliding group of 8 holds at
    # most 5 blocks in such a step (7 tokens behind it and 8 in it), the full group the rest.
    sched, _ = make_scheduler(num_blocks=25, kv_group_windows=windows,
                              max_num_batched_tokens=8, max_model_len=1 << 20)
    assert sched.max_request_tokens() == expected
    if expected < 1 << 20:             # a sliding-only model: any length fits
        with pytest.raises(ValueError, match="pool holds"):
            add(sched, "long", list(range(10, 20)), max_tokens=expected)
    add(sched, "fits", list(range(10, 20)), max_tokens=min(expected, 1 << 20) - 10)


def test_a_reply_for_another_number_of_groups_is_refused() -> None:
    sched, _ = make_scheduler(num_blocks=50, kv_group_windows=WINDOWS)
    add(sched, "a", list(range(100, 110)))
    uniform = make_scheduler(num_blocks=50)[1]          # a pool configured without groups
    with pytest.raises(RuntimeError, match="KV groups"):
        sched.apply_plan(uniform.apply(sched.schedule()))
