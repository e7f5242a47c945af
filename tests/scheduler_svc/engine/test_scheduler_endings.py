"""Scheduler unit tests for how requests end: token-level stop conditions, and failed steps
(exactly their requests fail; the prefix index keeps only what was written). Stop strings are
the front end's (tests/scheduler_svc/frontend/test_core_outputs.py, test_detokenizer.py)."""


from scheduler_svc.engine.request import FinishReason
from services.wire import StepError
from tests.scheduler_svc.engine.common import EOS, add, make_scheduler, sample, scheduled, step


def test_stop_conditions() -> None:
    sched, kv = make_scheduler()
    add(sched, "eos", [5, 6], max_tokens=10)
    add(sched, "min", [5, 6], max_tokens=10, min_tokens=2)
    add(sched, "ign", [5, 6], max_tokens=2, ignore_eos=True)
    add(sched, "sid", [5, 6], max_tokens=10, stop_token_ids=(77,))
    s = step(sched, kv)
    outs = {o.request_id: o for o in sched.update(
        sample(s, {"eos": EOS, "min": EOS, "ign": EOS, "sid": 77}))}
    assert outs["eos"].finish_reason is FinishReason.STOP
    assert outs["min"].finish_reason is None            # min_tokens not reached yet
    assert outs["ign"].finish_reason is None
    assert outs["sid"].finish_reason is FinishReason.STOP and outs["sid"].stop_reason == 77
    s = step(sched, kv)
    outs = {o.request_id: o for o in sched.update(sample(s, {"min": EOS, "ign": EOS}))}
    assert outs["min"].finish_reason is FinishReason.STOP
    assert outs["ign"].finish_reason is FinishReason.LENGTH


def fail(kv_written: bool) -> StepError:
    return StepError("RuntimeError: boom", kv_written)


def test_failed_step_fails_exactly_its_requests() -> None:
    sched, kv = make_scheduler(max_num_seqs=2)
    add(sched, "a", list(range(10, 20)), max_tokens=5)
    add(sched, "b", list(range(30, 36)), max_tokens=5)
    add(sched, "c", list(range(50, 53)), max_tokens=2)        # waits: max_num_seqs
    s = step(sched, kv)
    sched.update(sample(s, {"a": 1, "b": 1}))
    s = step(sched, kv)
    assert scheduled(s) == {"a": 1, "b": 1}
    outs, poisoned = sched.fail_step(s.step_id, fail(kv_written=False))
    assert not poisoned                     # a decode inside a block commits no hash
    assert {o.request_id for o in outs} == {"a", "b"}
    for o in outs:
        assert o.finish_reason is FinishReason.ABORT and o.new_token_ids == []
        assert o.error is not None and "boom" in o.error
    assert set(sched.requests) == {"c"}
    # The next step frees their blocks, tells the workers, and runs c.
    s = step(sched, kv)
    assert sorted(s.finished_ids) == ["a", "b"] and scheduled(s) == {"c": 3}
    assert kv.stats().num_used_blocks == 1
    sched.update(sample(s, {"c": 4}))
    s = step(sched, kv)
    (out,) = sched.update(sample(s, {"c": 5}))
    assert out.finish_reason is FinishReason.LENGTH and out.error is None


def test_failed_step_poisons_the_prefix_index_only_with_unwritten_commits() -> None:
    # A prefill of 3 full blocks commits their hashes when planned.
    for prefix_caching, kv_written, expected in [(True, False, True), (True, True, False),
                                                 (False, False, False)]:
        sched, kv = make_scheduler(prefix_caching=prefix_caching)
        add(sched, "a", list(range(10, 22)))
        s = step(sched, kv)
        outs, poisoned = sched.fail_step(s.step_id, fail(kv_written))
        assert poisoned is expected, (prefix_caching, kv_written)
        assert [o.request_id for o in outs] == ["a"]
    # A request aborted while its step ran still left its commits in the index.
    sched, kv = make_scheduler()
    add(sched, "a", list(range(10, 22)))
    s = step(sched, kv)
    sched.abort("a")
    outs, poisoned = sched.fail_step(s.step_id, fail(kv_written=False))
    assert outs == [] and poisoned


def test_failed_step_with_a_later_step_in_flight() -> None:
    sched, kv = make_scheduler(async_scheduling=True)
    add(sched, "a", list(range(10, 17)), max_tokens=8)
    add(sched, "b", list(range(30, 37)), max_tokens=3)
    s1 = step(sched, kv)
    s2 = step(sched, kv)                   # their decodes, planned before s1's output is back
    assert scheduled(s2) == {"a": 1, "b": 1}
    outs, poisoned = sched.fail_step(s1.step_id, fail(kv_written=True))
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    # s2 commits no block for them (its tokens were not known when planned): nothing the
    # worker skips in s2 was indexed, and s1 wrote its KV.
    assert not poisoned
    # s2's output (the worker skipped both) changes nothing; then their blocks go back.
    assert sched.update(sample(s2, {})) == []
    assert not sched.running and sched.has_work()
    assert step(sched, kv) is None and kv.stats().num_used_blocks == 0
    assert not sched.has_work()
