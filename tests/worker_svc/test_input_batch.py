"""InputBatch: applying StepInput diffs, and refusing bad ones without touching state."""

import pytest

from services.wire import NewRequest, RunningRequest, SamplingSpec, StepInput
from tests.worker_svc.common import GREEDY
from worker_svc.input_batch import InputBatch

BLOCK_SIZE = 4


def make_batch() -> InputBatch:
    return InputBatch(num_blocks=32, block_size=BLOCK_SIZE, vocab_size=100, max_model_len=64)


def new(request_id: str, token_ids: list[int], block_ids: list[int], num_new: int,
        num_computed: int = 0, num_prompt: int | None = None,
        sampling: SamplingSpec = GREEDY) -> NewRequest:
    return NewRequest(request_id=request_id, token_ids=token_ids,
                      num_prompt_tokens=len(token_ids) if num_prompt is None else num_prompt,
                      sampling=sampling, block_ids=[block_ids], num_computed_tokens=num_computed,
                      num_new_tokens=num_new)


def running(request_id: str, num_computed: int, num_new: int, new_block_ids: list[int] = (),
            new_token_ids: list[int] = ()) -> RunningRequest:
    return RunningRequest(request_id=request_id, num_computed_tokens=num_computed,
                          num_new_tokens=num_new, new_block_ids=[list(new_block_ids)],
                          new_token_ids=list(new_token_ids))


def step(step_id: int, new_requests=(), running_requests=(), finished=()) -> StepInput:
    return StepInput(step_id=step_id, new_requests=list(new_requests),
                     running=list(running_requests), finished_ids=list(finished))


def test_chunked_prefill_then_decode_as_a_non_last_rank() -> None:
    batch = make_batch()
    prompt = list(range(10, 20))
    first = batch.apply(step(0, [new("a", prompt, [3, 4], num_new=6)]))
    assert [(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in first] == [
        (0, 6, False)]
    last = batch.apply(step(1, running_requests=[running("a", 6, 4, new_block_ids=[7])]))
    assert [(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in last] == [(6, 4, True)]
    state = batch.requests["a"]
    assert state.block_ids == [[3, 4, 7]] and state.num_computed_tokens == 10

    # A non-last rank never samples: it learns the token from the next step's diff.
    decode = batch.apply(step(2, running_requests=[running("a", 10, 1, new_token_ids=[42])]))
    assert state.token_ids == prompt + [42]
    assert decode[0].samples and decode[0].num_computed_tokens == 10
    # Several tokens at once (e.g. after a batch queue) land at num_computed_tokens too.
    batch.apply(step(3, running_requests=[running("a", 11, 1, [8], new_token_ids=[43])]))
    assert state.token_ids == prompt + [42, 43]


def test_last_rank_receives_its_own_tokens_again() -> None:
    batch = make_batch()
    batch.apply(step(0, [new("a", [1, 2, 3], [1, 2], num_new=3)]))
    batch.requests["a"].token_ids.append(9)          # what the last stage's runner does
    batch.apply(step(1, running_requests=[running("a", 3, 1, new_token_ids=[9])]))
    assert batch.requests["a"].token_ids == [1, 2, 3, 9]
    batch.requests["a"].token_ids.append(5)
    batch.apply(step(2, running_requests=[running("a", 4, 1)]))   # one stage: nothing sent
    assert batch.requests["a"].token_ids == [1, 2, 3, 9, 5]


def test_finished_first_then_new_then_running_in_step_order() -> None:
    batch = make_batch()
    batch.apply(step(0, [new("a", [1, 2], [1], 2), new("b", [3, 4], [2], 2)]))
    # "a" was preempted: dropped and re-sent whole with its output so far, in one step.
    scheduled = batch.apply(step(1, [new("c", [5], [3], 1), new("a", [1, 2, 7], [4], 3)],
                                 [running("b", 2, 1, new_token_ids=[8])], finished=["a", "zz"]))
    assert [s.state.request_id for s in scheduled] == ["c", "a", "b"]
    assert batch.requests["a"].block_ids == [[4]]
    batch.apply(step(2, finished=["a", "b", "c"]))
    assert len(batch) == 0


def test_prefix_hit_starts_with_computed_tokens() -> None:
    batch = make_batch()
    [s] = batch.apply(step(0, [new("a", list(range(9)), [5, 6, 7], num_new=1, num_computed=8)]))
    assert (s.num_computed_tokens, s.num_new_tokens, s.samples) == (8, 1, True)


def test_seeded_random_request_gets_a_generator() -> None:
    batch = make_batch()
    seeded = SamplingSpec(temperature=0.8, top_p=1.0, top_k=-1, seed=3, num_logprobs=None)
    greedy_seeded = SamplingSpec(temperature=0.0, top_p=1.0, top_k=-1, seed=3, num_logprobs=None)
    batch.apply(step(0, [new("a", [1], [1], 1, sampling=seeded),
                         new("b", [1], [2], 1, sampling=greedy_seeded)]))
    assert batch.requests["a"].generator is not None
    assert batch.requests["b"].generator is None


# Against a batch holding "a": 5 prompt tokens computed, then the last stage appended 99.
BAD_STEPS = {
    "unknown running id": step(1, running_requests=[running("nope", 5, 1)]),
    "duplicate id": step(1, [new("b", [1], [9], 1), new("b", [1], [10], 1)]),
    "new id already held": step(1, [new("a", [1], [9], 1)]),
    "running and new in one step": step(1, [new("b", [1], [9], 1)], [running("b", 0, 1)]),
    "null block": step(1, [new("b", [1, 2], [0], 2)]),
    "block out of range": step(1, running_requests=[running("a", 5, 1, [32])]),
    "computed goes backwards": step(1, running_requests=[running("a", 4, 1)]),
    "computed skips ahead": step(1, running_requests=[running("a", 6, 1, [], [1])]),
    "computing unknown tokens": step(1, running_requests=[running("a", 5, 2)]),
    "tokens contradict": step(1, running_requests=[running("a", 5, 1, [], [98])]),
    "not enough blocks": step(1, running_requests=[running("a", 5, 4, [], [99, 1, 2, 3])]),
    "token outside vocab": step(1, running_requests=[running("a", 5, 2, [], [99, 100])]),
    "prompt longer than tokens": step(1, [new("b", [1], [9], 1, num_prompt=2)]),
    "past the context": step(1, [new("b", list(range(65)), list(range(9, 26)), 65)]),
    "prefix beyond tokens": step(1, [new("b", [1, 2], [9], 1, num_computed=2)]),
}


def batch_holding_a() -> InputBatch:
    batch = make_batch()
    batch.apply(step(0, [new("a", [1, 2, 3, 4, 5], [1, 2], 5)]))
    batch.requests["a"].token_ids.append(99)
    return batch


@pytest.mark.parametrize("name", sorted(BAD_STEPS))
def test_bad_diffs_raise_and_leave_state_alone(name: str) -> None:
    batch = batch_holding_a()
    with pytest.raises(ValueError):
        batch.apply(BAD_STEPS[name])
    assert set(batch.requests) == {"a"}
    state = batch.requests["a"]
    assert state.token_ids == [1, 2, 3, 4, 5, 99]
    assert state.block_ids == [[1, 2]]
    assert state.num_computed_tokens == 5


def test_non_last_rank_needs_the_sampled_token() -> None:
    batch = make_batch()
    batch.apply(step(0, [new("a", [1, 2, 3], [1], 3)]))
    # An empty new_token_ids is valid, but then there is nothing to compute.
    with pytest.raises(ValueError, match="only 3 are known"):
        batch.apply(step(1, running_requests=[running("a", 3, 1)]))
    batch.apply(step(1, running_requests=[running("a", 3, 1, new_token_ids=[7])]))
    assert batch.requests["a"].token_ids == [1, 2, 3, 7]


def test_failed_diff_does_not_apply_its_valid_parts() -> None:
    batch = make_batch()
    batch.apply(step(0, [new("a", [1, 2, 3], [1], 3)]))
    with pytest.raises(ValueError):
        batch.apply(step(1, [new("b", [4], [2], 1)], [running("ghost", 0, 1)], finished=["a"]))
    assert set(batch.requests) == {"a"}


def _hybrid() -> InputBatch:
    return InputBatch(num_blocks=32, block_size=BLOCK_SIZE, vocab_size=100, max_model_len=64,
                      kv_windows=(0, 8))


def test_a_hybrid_request_has_a_table_per_group_and_its_sliding_one_may_start_null() -> None:
    batch = _hybrid()
    prompt = list(range(1, 21))
    # A prefix hit of 16 tokens: the sliding group holds only the blocks its window reads.
    request = NewRequest("a", prompt, 20, GREEDY, [[1, 2, 3, 4, 5], [0, 0, 6, 7, 8]], 16, 4)
    [scheduled] = batch.apply(step(0, [request]))
    assert scheduled.state.block_ids == [[1, 2, 3, 4, 5], [0, 0, 6, 7, 8]]
    batch.apply(step(1, running_requests=[RunningRequest("a", 20, 1, [[9], [10]], [42])]))
    assert batch.requests["a"].block_ids == [[1, 2, 3, 4, 5, 9], [0, 0, 6, 7, 8, 10]]


@pytest.mark.parametrize("block_ids,new_block_ids", [
    ([[1, 2]], [[], []]),                     # one list for two groups
    ([[1, 2], [3, 4], [5, 6]], [[], []]),     # three
    ([[0, 2], [3, 4]], [[], []]),             # a full group never holds the null block
    ([[1, 2], [3, 0]], [[], []]),             # nor a sliding one after a real block
    ([[1, 2], [3]], [[], []]),                # groups of different lengths
    ([[1, 2], [3, 4]], [[5], []]),            # a grow that appends to one group only
    ([[1, 2], [3, 4]], [[5], [0]]),           # a grow never appends the null block
])
def test_bad_group_tables_are_refused(block_ids: list[list[int]],
                                      new_block_ids: list[list[int]]) -> None:
    batch = _hybrid()
    prompt = list(range(1, 8))
    good = NewRequest("a", prompt, 7, GREEDY, [[11, 12], [13, 14]], 0, 7)
    batch.apply(step(0, [good]))
    with pytest.raises(ValueError):
        batch.apply(step(1, [NewRequest("b", prompt, 7, GREEDY, block_ids, 0, 7)],
                         [RunningRequest("a", 7, 1, new_block_ids, [5])]))
    assert batch.requests["a"].block_ids == [[11, 12], [13, 14]] and "b" not in batch.requests
