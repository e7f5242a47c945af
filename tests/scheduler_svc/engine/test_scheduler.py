"""Scheduler unit tests: no tensors, no sockets. Plans go to kvcache_svc's real block manager
(the contract partner) in-process; step outputs are hand-made. How requests end (stops,
failed steps): test_scheduler_endings.py; preemption and the pool: test_scheduler_pool.py."""

import pytest

from scheduler_svc.engine.request import FinishReason, RequestStatus
from tests.scheduler_svc.engine.common import (
    EOS,
    add,
    applied,
    make_scheduler,
    sample,
    scheduled,
    step,
)


def test_prefill_then_decode_until_max_tokens() -> None:
    sched, kv = make_scheduler()
    add(sched, "a", list(range(10, 20)), max_tokens=3)
    s = step(sched, kv)
    assert s is not None and scheduled(s) == {"a": 10}
    assert s.new_requests[0].block_ids and len(s.new_requests[0].block_ids[0]) == 3
    outs = sched.update(sample(s, {"a": 7}))
    assert [o.new_token_ids for o in outs] == [[7]] and outs[0].finish_reason is None
    s = step(sched, kv)
    assert s is not None and scheduled(s) == {"a": 1} and not s.new_requests
    assert s.running[0].num_computed_tokens == 10
    sched.update(sample(s, {"a": 8}))
    s = step(sched, kv)
    outs = sched.update(sample(s, {"a": 9}))
    assert outs[0].finish_reason is FinishReason.LENGTH
    assert outs[0].num_output_tokens == 3
    # The next plan frees the blocks.
    assert not sched.requests and sched.has_work()
    sched.apply_plan(applied(kv, sched.schedule()))
    assert kv.stats().num_used_blocks == 0


def test_idle_after_the_last_free() -> None:
    sched, kv = make_scheduler()
    add(sched, "a", list(range(10, 20)), max_tokens=1)
    s = step(sched, kv)
    (out,) = sched.update(sample(s, {"a": 7}))
    assert out.finish_reason is FinishReason.LENGTH
    assert sched.has_work() and sched.has_schedulable()      # a's blocks are still held
    plan = sched.schedule()
    assert plan.free_ids == ["a"] and not plan.grows and not plan.admits
    assert sched.apply_plan(kv.apply(plan)) is None            # nothing to run
    assert kv.stats().num_used_blocks == 0
    # Idle: no further plan is drafted (the engine blocks until a request arrives), though
    # the workers have not yet heard that a finished.
    assert not sched.has_work() and not sched.has_schedulable()
    # They hear it with the next step that runs something.
    add(sched, "b", [1, 2, 3])
    s = step(sched, kv)
    assert s.finished_ids == ["a"] and scheduled(s) == {"b": 3}


def test_chunked_prefill_respects_budget_and_discards_partial_samples() -> None:
    sched, kv = make_scheduler(max_num_batched_tokens=8)
    add(sched, "a", list(range(100, 120)))            # 20 tokens -> chunks of 8, 8, 4
    s1 = step(sched, kv)
    assert scheduled(s1) == {"a": 8}
    # A worker would not sample a non-final chunk; even if it did, the token is dropped.
    assert sched.update(sample(s1, {"a": 1})) == []
    s2 = step(sched, kv)
    assert scheduled(s2) == {"a": 8} and s2.running[0].num_computed_tokens == 8
    sched.update(sample(s2, {}))
    s3 = step(sched, kv)
    assert scheduled(s3) == {"a": 4}
    outs = sched.update(sample(s3, {"a": 5}))
    assert outs[0].new_token_ids == [5]


def test_no_chunked_prefill_schedules_whole_prompts_only() -> None:
    sched, kv = make_scheduler(max_num_batched_tokens=8, chunked_prefill=False,
                               max_model_len=16)
    # With chunking off the budget grows to the context length (as vLLM requires).
    assert sched.config.token_budget == 16
    add(sched, "a", list(range(12)))
    add(sched, "b", list(range(50, 60)))
    s = step(sched, kv)
    assert scheduled(s) == {"a": 12}       # b (10 tokens) does not fit the rest (4): waits
    sched.update(sample(s, {"a": 3}))
    s = step(sched, kv)
    assert scheduled(s) == {"a": 1, "b": 10}  # b needs 10 of the 15 left: whole, now


def test_budget_shared_in_arrival_order_and_max_num_seqs() -> None:
    sched, kv = make_scheduler(max_num_batched_tokens=12, max_num_seqs=2)
    for i, rid in enumerate("abc"):
        add(sched, rid, list(range(10 * i, 10 * i + 5)))
    s = step(sched, kv)
    assert scheduled(s) == {"a": 5, "b": 5}  # c waits: max_num_seqs
    sched.update(sample(s, {"a": 1, "b": 1}))
    s = step(sched, kv)
    assert scheduled(s) == {"a": 1, "b": 1}


def test_prefix_cache_hit_at_admission_leaves_one_token_to_compute() -> None:
    sched, kv = make_scheduler()
    prompt = list(range(40, 52))                       # 12 tokens = 3 full blocks
    add(sched, "a", prompt, max_tokens=1)
    s = step(sched, kv)
    outs = sched.update(sample(s, {"a": 9}))
    assert outs[0].finish_reason is FinishReason.LENGTH
    add(sched, "b", prompt, max_tokens=1)
    s = step(sched, kv)
    new = s.new_requests[0]
    # All 3 blocks are cached, but one token must be computed: 8 cached, 4 new.
    assert (new.num_computed_tokens, new.num_new_tokens) == (8, 4)
    outs = sched.update(sample(s, {"b": 9}))
    assert outs[0].num_cached_tokens == 8
    assert sched.num_cached_tokens_admitted == 8


def test_same_step_prefix_sharing() -> None:
    # Two identical prompts admitted in one step: the second reuses the first's full block,
    # committed in the same plan (workers write a step's KV before any attention reads it).
    sched, kv = make_scheduler()
    add(sched, "a", list(range(5)))
    add(sched, "b", list(range(5)))
    s = step(sched, kv)
    a, b = s.new_requests
    assert (b.num_computed_tokens, b.num_new_tokens) == (4, 1)
    assert b.block_ids[0][0] == a.block_ids[0][0]


def test_shared_prefix_between_live_requests() -> None:
    sched, kv = make_scheduler()
    system = list(range(200, 208))                    # 2 shared blocks
    add(sched, "a", system + [1, 2, 3], max_tokens=2)
    s = step(sched, kv)
    sched.update(sample(s, {"a": 5}))
    add(sched, "b", system + [7, 8, 9], max_tokens=2)
    s = step(sched, kv)
    b = next(r for r in s.new_requests if r.request_id == "b")
    assert b.num_computed_tokens == 8
    a_blocks = sched.requests["a"].block_ids[0]
    assert b.block_ids[0][:2] == a_blocks[:2]


def test_cache_salt_separates_prefixes() -> None:
    """Tenants with different salts never share cached blocks, whether the first request has
    finished (its blocks cached and free) or is admitted in the same step; equal salts share
    as unsalted requests do."""
    sched, kv = make_scheduler()
    prompt = list(range(60, 72))                       # 12 tokens = 3 full blocks

    def admitted(rid: str, salt: bytes) -> int:
        add(sched, rid, prompt, max_tokens=1, cache_salt=salt)
        s = step(sched, kv)
        sched.update(sample(s, {rid: 9}))
        return s.new_requests[0].num_computed_tokens

    assert admitted("a1", b"tenant-a") == 0
    assert admitted("a2", b"tenant-a") == 8            # same salt: hit (one token computed)
    assert admitted("b1", b"tenant-b") == 0            # other salt: nothing to see
    assert admitted("none", b"") == 0                  # unsalted: no hit on salted blocks
    assert admitted("b2", b"tenant-b") == 8
    add(sched, "c1", prompt, cache_salt=b"tenant-c")
    add(sched, "d1", prompt, cache_salt=b"tenant-d")
    c, d = step(sched, kv).new_requests
    assert (c.num_computed_tokens, d.num_computed_tokens) == (0, 0)
    assert not set(c.block_ids[0]) & set(d.block_ids[0])


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 8 usable blocks of 4 tokens; two 12-token prompts (3 blocks each) growing by decode.
    sched, kv = make_scheduler(num_blocks=9, prefix_caching=False, max_num_batched_tokens=64)
    a = add(sched, "a", list(range(12)), max_tokens=12)
    b = add(sched, "b", list(range(20, 32)), max_tokens=12)
    s = step(sched, kv)
    assert scheduled(s) == {"a": 12, "b": 12}
    sched.update(sample(s, {"a": 3, "b": 3}))
    preempted_seen = False
    tokens = {"a": 0, "b": 0}
    for _ in range(40):
        s = step(sched, kv)
        if s is None:
            continue
        if "b" in s.finished_ids:
            preempted_seen = True
        live = {rid: 3 for rid in scheduled(s)
                if sched.requests.get(rid) is not None
                and sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens}
        for out in sched.update(sample(s, live)):
            tokens[out.request_id] += len(out.new_token_ids)
        if not sched.requests:
            break
    assert preempted_seen, "b (the latest) should have been preempted"
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert tokens == {"a": 11, "b": 11}    # + the first step's token: nothing lost
    assert a.status is RequestStatus.FINISHED and b.status is RequestStatus.FINISHED


def test_resumed_request_is_sent_in_full_with_its_outputs() -> None:
    sched, kv = make_scheduler(num_blocks=9, prefix_caching=False, max_num_batched_tokens=64)
    add(sched, "a", list(range(12)), max_tokens=12)
    b = add(sched, "b", list(range(20, 32)), max_tokens=12)
    for _ in range(40):
        s = step(sched, kv)
        if s is None:
            continue
        resumed = [r for r in s.new_requests if r.request_id == "b" and b.num_preemptions]
        if resumed:
            assert resumed[0].token_ids == b.token_ids[:len(resumed[0].token_ids)]
            assert len(resumed[0].token_ids) > 12   # prompt + outputs so far
            assert resumed[0].num_computed_tokens == 0
            return
        live = {rid: 3 for rid in scheduled(s)
                if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens}
        sched.update(sample(s, live))
    pytest.fail("b was never resumed")

def test_abort_waiting_and_running() -> None:
    sched, kv = make_scheduler()
    add(sched, "a", [1, 2, 3])
    s = step(sched, kv)
    add(sched, "b", [1, 2, 3])
    assert sched.abort("b").finish_reason is FinishReason.ABORT
    assert sched.abort("a").finish_reason is FinishReason.ABORT
    assert sched.abort("zzz") is None
    # The in-flight step's token for an aborted request is dropped.
    assert sched.update(sample(s, {"a": 4})) == []
    plan = sched.schedule()
    assert plan.free_ids == ["a"]
    reply = kv.apply(plan)
    assert reply.num_free_blocks == 63
    assert sched.apply_plan(reply) is None


def test_new_token_ids_shipped_only_for_pipeline() -> None:
    for ship in (False, True):
        sched, kv = make_scheduler(ship_sampled_tokens=ship)
        add(sched, "a", [1, 2, 3], max_tokens=5)
        s = step(sched, kv)
        sched.update(sample(s, {"a": 42}))
        s = step(sched, kv)
        assert s.running[0].new_token_ids == ([42] if ship else [])


def test_duplicate_request_id_rejected() -> None:
    sched, _ = make_scheduler()
    add(sched, "a", [1])
    with pytest.raises(ValueError, match="already live"):
        add(sched, "a", [2])


def test_batch_queue_keeps_batches_disjoint_and_balanced() -> None:
    sched, kv = make_scheduler(max_num_batched_tokens=64, num_batches=2)
    for i in range(4):
        add(sched, f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=3)
    s1 = step(sched, kv)
    assert sorted(scheduled(s1)) == ["r0", "r1"]          # half of the 4 live requests
    s2 = step(sched, kv)
    assert sorted(scheduled(s2)) == ["r2", "r3"]          # disjoint from the batch in flight
    assert step(sched, kv) is None                        # all four are in flight
    sched.update(sample(s1, {"r0": 1, "r1": 1}))
    s3 = step(sched, kv)
    assert sorted(scheduled(s3)) == ["r0", "r1"]          # back as soon as their output is in
    assert all(r.num_new_tokens == 1 for r in s3.running)
    sched.update(sample(s2, {"r2": 1, "r3": 1}))
    s4 = step(sched, kv)
    assert sorted(scheduled(s4)) == ["r2", "r3"]


def test_in_flight_requests_are_never_preempted() -> None:
    sched, kv = make_scheduler(num_blocks=6, prefix_caching=False, max_num_batched_tokens=64,
                               num_batches=2)
    a = add(sched, "a", list(range(8)), max_tokens=8)     # 2 blocks each, 5 usable
    b = add(sched, "b", list(range(20, 28)), max_tokens=8)
    s1 = step(sched, kv)
    assert sorted(scheduled(s1)) == ["a"]
    s2 = step(sched, kv)
    assert sorted(scheduled(s2)) == ["b"]
    sched.update(sample(s1, {"a": 1}))
    for _ in range(3):                                    # a grows while b stays in flight
        s = step(sched, kv)
        if s is None:
            break
        assert "b" not in scheduled(s)
        sched.update(sample(s, {"a": 1}))
    assert b.num_preemptions == 0 and b.in_flight
    assert a.status.value in ("running", "finished")


def test_async_scheduling_plans_the_next_decode_before_the_output() -> None:
    sched, kv = make_scheduler(async_scheduling=True)
    add(sched, "a", list(range(6)), max_tokens=3)
    s1 = step(sched, kv)
    assert scheduled(s1) == {"a": 6}
    s2 = step(sched, kv)                     # a's first token is still being sampled
    assert scheduled(s2) == {"a": 1} and s2.running[0].num_computed_tokens == 6
    assert step(sched, kv) is None           # only one step ahead
    outs = sched.update(sample(s1, {"a": 11}))
    assert [o.new_token_ids for o in outs] == [[11]]
    s3 = step(sched, kv)
    assert scheduled(s3) == {"a": 1} and s3.running[0].num_computed_tokens == 7
    sched.update(sample(s2, {"a": 12}))
    # Two outputs known + one pending = max_tokens: nothing more is scheduled.
    assert step(sched, kv) is None
    outs = sched.update(sample(s3, {"a": 13}))
    assert outs[0].finish_reason is FinishReason.LENGTH and outs[0].num_output_tokens == 3


def test_async_scheduling_drops_the_token_after_a_stop() -> None:
    sched, kv = make_scheduler(async_scheduling=True)
    add(sched, "a", [5, 6], max_tokens=10)
    s1 = step(sched, kv)
    s2 = step(sched, kv)
    outs = sched.update(sample(s1, {"a": EOS}))
    assert outs[0].finish_reason is FinishReason.STOP
    assert sched.update(sample(s2, {"a": 99})) == []   # computed, never emitted
