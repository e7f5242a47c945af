"""The scheduler's waiting queue by policy (scheduler_svc.engine.fair_queue), driven with the
real block manager and hand-made step outputs: under `fair` a second client's request is
admitted in the first step after slots free, however many the first client has waiting;
under `fcfs` it waits behind all of them."""

import pytest

from scheduler_svc.engine.request import Request, SamplingParams
from scheduler_svc.engine.scheduler import Scheduler
from tests.scheduler_svc.engine.common import EOS, make_scheduler, sample, scheduled, step

NUM_FLOOD = 1000
MAX_NUM_SEQS = 8


def add_for(sched: Scheduler, request_id: str, client: str, max_tokens: int = 4) -> None:
    cfg = sched.config
    sched.add_request(Request(request_id, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens),
                              (EOS,), cfg.max_model_len, cfg.block_size,
                              hash_blocks=cfg.prefix_caching, client=client))


def steps_until_admitted(policy: str, max_steps: int) -> tuple[int | None, int | None]:
    """(the first step after a slot freed, the step that admitted the control request),
    counted from the control's arrival; None where it did not happen within `max_steps`."""
    sched, kv = make_scheduler(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=64,
                               scheduling_policy=policy)
    for i in range(NUM_FLOOD):
        add_for(sched, f"flood-{i}", "flooder")
    s = step(sched, kv)
    assert s is not None and len(s.new_requests) == MAX_NUM_SEQS
    sched.update(sample(s, dict.fromkeys(scheduled(s), 7)))
    add_for(sched, "control", "control")
    assert len(sched.waiting) == NUM_FLOOD - MAX_NUM_SEQS + 1
    freed = admitted = None
    for n in range(1, max_steps + 1):
        full = len(sched.running) == MAX_NUM_SEQS
        s = step(sched, kv)
        assert s is not None
        if freed is None and not full:
            freed = n
        if any(r.request_id == "control" for r in s.new_requests):
            admitted = n
            break
        sched.update(sample(s, dict.fromkeys(scheduled(s), 7)))
    return freed, admitted


def test_fair_admits_another_client_in_the_first_step_after_slots_free() -> None:
    freed, admitted = steps_until_admitted("fair", 20)
    assert freed is not None and admitted == freed, (freed, admitted)


def test_fcfs_keeps_another_client_behind_the_whole_flood() -> None:
    """The old behaviour: a plain FIFO, the control after all of the flood's requests (a
    wave of MAX_NUM_SEQS every few steps: not within 20 steps)."""
    freed, admitted = steps_until_admitted("fcfs", 20)
    assert freed is not None and admitted is None, (freed, admitted)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_scheduler(scheduling_policy="lottery")
