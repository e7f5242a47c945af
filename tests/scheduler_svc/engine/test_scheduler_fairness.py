"""The scheduler's waiting queue by policy (scheduler_svc.engine.fair_queue), driven with the
real block manager and hand-made step outputs: under `fair` a second client's request is
admitted in the very next step, taking one of the first client's slots (none has freed),
however many the first client has waiting, and more of its requests take more slots, up to an
equal share; under `fcfs` it waits behind all of them."""

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


def test_fair_admits_another_client_in_the_next_step_taking_a_slot() -> None:
    freed, admitted = steps_until_admitted("fair", 20)
    assert freed is None and admitted == 1, (freed, admitted)


def test_newcomers_take_slots_at_once_and_the_preempted_resume_first() -> None:
    sched, kv = make_scheduler(num_blocks=256, max_num_seqs=MAX_NUM_SEQS,
                               max_num_batched_tokens=64)
    for i in range(NUM_FLOOD):
        add_for(sched, f"flood-{i}", "flooder", max_tokens=50)
    s = step(sched, kv)                          # the flood takes every slot
    assert s is not None and len(s.new_requests) == MAX_NUM_SEQS
    sched.update(sample(s, dict.fromkeys(scheduled(s), 7)))
    for i in range(3):                           # three clients join, one request each
        add_for(sched, f"control-{i}", f"control-{i}", max_tokens=50)
    s = step(sched, kv)
    assert s is not None
    # In the next step, no slot having freed: each took one of the flood's newest.
    assert sorted(r.request_id for r in s.new_requests) == [f"control-{i}" for i in range(3)]
    held = [r.client for r in sched.running]
    assert held.count("flooder") == MAX_NUM_SEQS - 3 and len(held) == MAX_NUM_SEQS
    preempted = [r for r in sched.requests.values() if r.num_preemptions]
    assert sorted(r.request_id for r in preempted) == ["flood-5", "flood-6", "flood-7"]
    assert all(r.num_output_tokens == 1 for r in preempted)     # recomputed with their token
    # They head the flooder's queue again, in their order, ahead of its requests never run.
    assert [r.request_id for r in sched.waiting][:4] == ["flood-5", "flood-6", "flood-7",
                                                         "flood-8"]
    # control-0 sends one more at a time (each joins anew: none of its are queued): each
    # takes a flood slot while it holds two fewer, then the shares stay (a turn each).
    for i in range(4):
        add_for(sched, f"control-0-{i}", "control-0", max_tokens=50)
        sched.update(sample(s, dict.fromkeys(scheduled(s), 7)))
        s = step(sched, kv)
        assert s is not None
    held = [r.client for r in sched.running]
    assert (held.count("flooder"), held.count("control-0")) == (3, 3), held
    assert len(sched.waiting) > NUM_FLOOD - MAX_NUM_SEQS    # the last one waits its turn


def test_fcfs_keeps_another_client_behind_the_whole_flood() -> None:
    """The old behaviour: a plain FIFO, the control after all of the flood's requests (a
    wave of MAX_NUM_SEQS every few steps: not within 20 steps)."""
    freed, admitted = steps_until_admitted("fcfs", 20)
    assert freed is not None and admitted is None, (freed, admitted)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_scheduler(scheduling_policy="lottery")


def test_a_client_with_many_queued_converges_to_an_equal_share() -> None:
    """A client already served, with requests queued, takes a slot a step from the client
    holding most until they hold equal shares; then nothing more is preempted."""
    sched, kv = make_scheduler(num_blocks=256, max_num_seqs=MAX_NUM_SEQS,
                               max_num_batched_tokens=64)
    for i in range(NUM_FLOOD):
        add_for(sched, f"flood-{i}", "flooder", max_tokens=50)
    s = step(sched, kv)
    assert s is not None
    for i in range(MAX_NUM_SEQS):                # one client, many at once
        add_for(sched, f"control-{i}", "control", max_tokens=50)
    shares = []
    for _ in range(8):
        sched.update(sample(s, dict.fromkeys(scheduled(s), 7)))
        s = step(sched, kv)
        assert s is not None
        held = [r.client for r in sched.running]
        shares.append((held.count("flooder"), held.count("control")))
    assert shares[:4] == [(7, 1), (6, 2), (5, 3), (4, 4)], shares
    assert shares[4:] == [(4, 4)] * 4, shares
    assert sched.num_preemptions == 4


def test_under_async_scheduling_a_slot_in_flight_is_given_up_a_step_later() -> None:
    """Async scheduling keeps a decode's next step in flight: its request cannot be
    preempted then. It sits the next step out instead, and gives its slot up at the one
    after, idle."""
    sched, kv = make_scheduler(num_blocks=256, max_num_seqs=MAX_NUM_SEQS,
                               max_num_batched_tokens=64, async_scheduling=True)
    for i in range(NUM_FLOOD):
        add_for(sched, f"flood-{i}", "flooder", max_tokens=50)
    first = step(sched, kv)                      # the flood's prefills
    assert first is not None and len(first.new_requests) == MAX_NUM_SEQS
    second = step(sched, kv)                     # its first decodes, planned ahead
    assert second is not None
    sched.update(sample(first, dict.fromkeys(scheduled(first), 7)))
    add_for(sched, "control", "control")
    # flood-7 is in `second`, in flight: held back, the control not admitted yet.
    third = step(sched, kv)
    assert third is not None and "flood-7" not in scheduled(third)
    assert "control" not in scheduled(third) and sched.num_preemptions == 0
    sched.update(sample(second, dict.fromkeys(scheduled(second), 7)))
    # flood-7 is idle now: preempted, and the control takes its slot.
    fourth = step(sched, kv)
    assert fourth is not None and [r.request_id for r in fourth.new_requests] == ["control"]
    assert sched.num_preemptions == 1
    assert sched.requests["flood-7"].num_preemptions == 1
