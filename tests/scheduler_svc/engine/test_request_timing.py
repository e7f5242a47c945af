"""A request's phases as its engine core times them (scheduler_svc.engine.request.Request.
timing: queue, prefill, decode, inference), carried to the front end in its finish record
(scheduler_svc.engine.wire.Finished.timing), validated on the way in."""

import math

import pytest

from scheduler_svc.engine.outputs import StepPacker
from scheduler_svc.engine.request import Request, SamplingParams
from scheduler_svc.engine.wire import EngineOutputs, Finished, Timing
from services.codec import Codec, DecodeError
from tests.scheduler_svc.engine.common import EOS, add, make_scheduler, sample, step


class ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    c = ManualClock()
    monkeypatch.setattr("scheduler_svc.engine.request.clock", c)
    return c


def test_phases_from_arrival_to_last_token(clock: ManualClock) -> None:
    sched, kv = make_scheduler()
    request = add(sched, "r", [5, 6, 7], max_tokens=3, ignore_eos=True)   # arrives at 100
    clock.now = 102.0
    s = step(sched, kv)                                  # scheduled at 102
    assert s is not None and request.scheduled_time == 102.0
    clock.now = 105.0
    sched.update(sample(s, {"r": 11}))                   # first token at 105
    clock.now = 106.0
    s = step(sched, kv)
    assert s is not None
    sched.update(sample(s, {"r": 12}))
    clock.now = 109.0
    s = step(sched, kv)
    assert s is not None
    packer = StepPacker()
    sched.update_packed(sample(s, {"r": 13}), packer)    # last token (length) at 109
    (fin,) = packer.messages(0, 1)[0].finished
    assert fin.reason == "length"
    assert fin.timing == Timing(queued_s=2.0, prefill_s=3.0, decode_s=4.0, inference_s=7.0)


def test_preemption_keeps_the_first_schedule(clock: ManualClock) -> None:
    request = Request("r", [5, 6], SamplingParams(max_tokens=4), (EOS,), 64, 4, False)
    clock.now = 101.0
    request.mark_scheduled()
    clock.now = 103.0
    request.append_token(9)
    request.reset_for_preemption()              # back to waiting; its first token stays
    clock.now = 110.0
    request.append_token(10)
    assert request.timing() == Timing(queued_s=1.0, prefill_s=2.0, decode_s=7.0,
                                      inference_s=9.0)


def test_never_scheduled_has_no_phases_and_no_token_is_all_prefill(clock: ManualClock) -> None:
    sched, kv = make_scheduler()
    waiting = add(sched, "w", [5, 6])
    out = sched.abort("w")
    assert out is not None and out.timing is None and waiting.timing() is None

    add(sched, "a", [5, 6])
    clock.now = 101.0
    assert step(sched, kv) is not None
    clock.now = 104.0
    out = sched.abort("a")                       # ended before its first token
    assert out is not None and out.timing == Timing(queued_s=1.0, prefill_s=3.0, decode_s=0.0,
                                                    inference_s=3.0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_a_finish_record_with_bad_timing_is_refused(bad: float) -> None:
    def message(timing: Timing) -> EngineOutputs:
        fin = Finished(handle=1, reason="stop", stop_token_id=None, num_prompt_tokens=2,
                       num_output_tokens=1, num_cached_tokens=0, num_store_loaded_tokens=0,
                       timing=timing)
        return EngineOutputs(replica_id=0, engine_epoch=1, num_rows=0, handles=b"",
                             token_ids=b"", finished=[fin], logprobs=[], prompt_logprobs=[])

    codec = Codec(EngineOutputs, key=b"k" * 32)
    good = Timing(queued_s=0.5, prefill_s=0.1, decode_s=0.2, inference_s=0.3)
    assert codec.decode(codec.encode(message(good))).finished[0].timing == good
    # Structs are not checked as they are built, only as they are decoded: the receiver's.
    bad_timing = Timing(queued_s=0.5, prefill_s=0.1, decode_s=bad, inference_s=0.3)
    with pytest.raises(DecodeError, match="float"):
        codec.decode(codec.encode(message(bad_timing)))
