"""InputBatch and the step output with compact decode rows (services.wire.DecodeRows): the
same scheduled rows as the RunningRequests they stand for, bad rows refused without touching
state, and rows of requests a failed step dropped skipped (token -1) until their ids finish."""

import numpy as np
import pytest
import torch

from services.wire import DecodeRows, NewRequest, RunningRequest, StepInput
from tests.worker_svc.common import GREEDY
from worker_svc.input_batch import InputBatch
from worker_svc.launched_step import LaunchedStep, SampledTokens
from worker_svc.pending_tokens import PendingTokens
from worker_svc.step_output import step_output

BLOCK_SIZE = 4


def rows(*pairs: tuple[int, int]) -> DecodeRows:
    return DecodeRows(slots=np.asarray([s for s, _ in pairs], "<i4").tobytes(),
                      num_computed_tokens=np.asarray([c for _, c in pairs], "<i4").tobytes())


def new(request_id: str, token_ids: list[int], block_ids: list[int], slot: int) -> NewRequest:
    return NewRequest(request_id=request_id, token_ids=token_ids,
                      num_prompt_tokens=len(token_ids), sampling=GREEDY,
                      block_ids=[block_ids], num_computed_tokens=0,
                      num_new_tokens=len(token_ids), slot=slot)


def step(step_id: int, new_requests=(), running=(), finished=(),
         decodes: DecodeRows | None = None) -> StepInput:
    return StepInput(step_id=step_id, new_requests=list(new_requests), running=list(running),
                     finished_ids=list(finished), decodes=decodes)


def holding_ab() -> InputBatch:
    """"a" (slot 3) and "b" (slot 0): prompts computed, each with its sampled token."""
    batch = InputBatch(num_blocks=32, block_size=BLOCK_SIZE, vocab_size=100, max_model_len=64)
    batch.apply(step(0, [new("a", [1, 2, 3], [1], slot=3), new("b", [4, 5], [2], slot=0)]))
    batch.requests["a"].token_ids.append(7)      # what the last stage appends
    batch.requests["b"].token_ids.append(8)
    return batch


def test_rows_schedule_as_the_running_requests_they_stand_for() -> None:
    compact, reference = holding_ab(), holding_ab()
    got = compact.apply(step(1, decodes=rows((0, 2), (3, 3))))
    want = reference.apply(step(1, running=[
        RunningRequest(request_id=rid, num_computed_tokens=c, num_new_tokens=1,
                       new_block_ids=[[]], new_token_ids=[]) for rid, c in (("b", 2), ("a", 3))]))
    assert [(s.state.request_id, s.num_computed_tokens, s.num_new_tokens, s.samples)
            for s in got] == [(s.state.request_id, s.num_computed_tokens, s.num_new_tokens,
                               s.samples) for s in want] == [("b", 2, 1, True), ("a", 3, 1, True)]
    assert [s.decode_row for s in got] == [0, 1]
    for rid in "ab":
        assert compact.requests[rid].num_computed_tokens == \
            reference.requests[rid].num_computed_tokens


# Against holding_ab(): "a" at slot 3 (3 computed of 4), "b" at slot 0 (2 of 3).
BAD = {
    "empty slot": step(1, decodes=rows((1, 3))),
    "slot past the table": step(1, decodes=rows((40, 3))),
    "negative slot": step(1, decodes=rows((-1, 3))),
    "a row twice": step(1, decodes=rows((3, 3), (3, 3))),
    "a row and a running entry": step(1, running=[RunningRequest(
        request_id="a", num_computed_tokens=3, num_new_tokens=1, new_block_ids=[[]],
        new_token_ids=[])], decodes=rows((3, 3))),
    "computed behind": step(1, decodes=rows((3, 2))),
    "computed ahead": step(1, decodes=rows((3, 4))),
    "ragged arrays": step(1, decodes=DecodeRows(slots=b"\x03\x00\x00\x00",
                                                num_computed_tokens=b"")),
    "not whole int32s": step(1, decodes=DecodeRows(slots=b"\x03\x00\x00",
                                                   num_computed_tokens=b"\x03\x00\x00")),
    "a new request on a held slot": step(1, [new("c", [9], [5], slot=3)]),
    "two new requests on one slot": step(1, [new("c", [9], [5], slot=6),
                                             new("d", [9], [6], slot=6)]),
    "a row of its finished request": step(1, finished=["a"], decodes=rows((3, 3))),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_rows_raise_and_leave_state_alone(name: str) -> None:
    batch = holding_ab()
    with pytest.raises(ValueError):
        batch.apply(BAD[name])
    assert set(batch.requests) == {"a", "b"}
    assert [batch.requests[r].num_computed_tokens for r in "ab"] == [3, 2]
    assert batch.slots[3] is batch.requests["a"] and batch.slots[0] is batch.requests["b"]


def test_a_row_needs_a_block_for_its_token() -> None:
    batch = holding_ab()
    batch.apply(step(1, decodes=rows((3, 3))))        # "a" fills its block: 4 of 4
    batch.requests["a"].token_ids.append(9)
    with pytest.raises(ValueError, match="cannot hold"):
        batch.apply(step(2, decodes=rows((3, 4))))


def test_a_freed_slot_takes_a_new_request_in_the_same_step() -> None:
    batch = holding_ab()
    [s] = batch.apply(step(1, [new("c", [9, 9], [5], slot=3)], finished=["a"]))
    assert s.state.request_id == "c" and batch.slots[3] is batch.requests["c"]


def test_rows_of_a_failed_step_are_skipped_until_their_ids_finish() -> None:
    batch = holding_ab()
    failed = step(1, decodes=rows((3, 3)))
    batch.apply(failed)
    batch.discard(failed)                             # "a" dropped: the scheduler fails it
    assert set(batch.requests) == {"b"}
    # Sent before the scheduler learnt of it: "a"'s row is skipped, "b"'s runs.
    later = step(2, decodes=rows((3, 4), (0, 2)))
    scheduled = batch.apply(later)
    assert [(s.state.request_id, s.decode_row) for s in scheduled] == [("b", 1)]
    # Its token comes back as -1; "b"'s in its row.
    launched = LaunchedStep(later, scheduled)
    launched.tokens = SampledTokens(scheduled, token_ids=[42], logprobs=[None])
    out = step_output(launched, "w", PendingTokens())
    assert out.request_ids == [] and np.frombuffer(out.decode_token_ids, "<i4").tolist() == [-1, 42]
    # Once its id finishes, the slot is an ordinary free one again.
    batch.apply(step(3, [new("c", [9], [6], slot=3)], finished=["a"]))
    with pytest.raises(ValueError, match="no request held"):
        batch.apply(step(4, decodes=rows((5, 0))))
    assert batch.slots[3] is batch.requests["c"]


def test_step_output_packs_row_tokens_in_row_order_after_the_others() -> None:
    batch = holding_ab()
    s = step(1, [new("c", [9, 9], [5], slot=1)], decodes=rows((3, 3), (0, 2)))
    scheduled = batch.apply(s)
    assert [x.state.request_id for x in scheduled] == ["c", "a", "b"]
    launched = LaunchedStep(s, scheduled)
    # Sampled in a layout of another order (one-token rows first), greedy on the "device".
    layout = [scheduled[2], scheduled[1], scheduled[0]]
    pending = PendingTokens()
    launched.tokens = sampled = SampledTokens(layout)
    pending.hold(sampled, torch.tensor([11, 12, 13]), torch.device("cpu"))
    out = step_output(launched, "w", pending)
    assert out.request_ids == ["c"] and out.sampled_token_ids == [13]
    assert np.frombuffer(out.decode_token_ids, "<i4").tolist() == [12, 11]


@pytest.mark.parametrize("agreed", [8, 6])
def test_a_row_right_after_a_load_starts_where_every_rank_loaded(agreed: int) -> None:
    """A load-only step, then the request's one remaining token as a decode row: from the
    load's end, or from what every rank got when this one loaded more (its count rolls back)."""
    batch = InputBatch(num_blocks=32, block_size=BLOCK_SIZE, vocab_size=100, max_model_len=64)
    prompt = list(range(10, 19))                       # 9 tokens, 8 of them in the store
    load = NewRequest(request_id="a", token_ids=prompt, num_prompt_tokens=9, sampling=GREEDY,
                      block_ids=[[1, 2, 3]], num_computed_tokens=0, num_new_tokens=0,
                      num_load_tokens=8, slot=2)
    batch.apply(step(0, [load]))
    state = batch.requests["a"]
    state.num_computed_tokens = 8                      # this rank loaded all 8
    if agreed == 8:
        [s] = batch.apply(step(1, decodes=rows((2, 8))))
        assert (s.num_computed_tokens, s.num_new_tokens, s.decode_row) == (8, 1, 0)
        assert state.num_computed_tokens == 9 and state.load_start is None
    else:                                              # a row is one token: 6 -> 9 is not
        with pytest.raises(ValueError, match="a decode row from 6"):
            batch.apply(step(1, decodes=rows((2, agreed))))
