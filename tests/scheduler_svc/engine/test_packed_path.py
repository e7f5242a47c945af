"""The engine core's fast paths against the object paths they replace, on randomized step
sequences (issue 37): twin schedulers, each with kvcache_svc's real block manager in-process,
get the same admissions, aborts, worker outputs (EOS, stop token ids, min_tokens, max_tokens,
logprobs, prompt logprobs, a grammar that completes) and the same small pool (preemption).
One is the reference: every running request a RunningRequest, each step's outputs taken by
`update` (packed by `pack_outputs`). The other runs the fast paths: steady decodes as compact
rows (services.wire.DecodeRows, their tokens back packed) and `update_packed`. Every plan, every
StepInput (the compact rows read back as the RunningRequests they stand for), every message to
every front end and the state after each step must be the same."""

import random

import numpy as np
import pytest
from msgspec.structs import replace

from kvcache_svc.block_manager import ReplicaBlockManager
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.outputs import StepPacker, pack_outputs
from scheduler_svc.engine.request import Request, SamplingParams
from scheduler_svc.engine.scheduler import Scheduler
from services.wire import RunningRequest, StepInput, StepOutput, StepTimings, TokenLogprobs

EOS = 2
STOP_ID = 9
BLOCK_SIZE = 4


class CountingGrammar:
    """Stands in for a grammar state: complete after `length` tokens."""

    def __init__(self, length: int) -> None:
        self.left = length

    def next_token_mask(self) -> bytes:
        return b"\xff\xff\xff\xff"

    def advance(self, token_id: int) -> bool:
        self.left -= 1
        return self.left <= 0


def twin(config: SchedulerConfig, num_blocks: int, **knobs: object,
         ) -> tuple[Scheduler, ReplicaBlockManager]:
    sched = Scheduler(config, **knobs)  # type: ignore[arg-type]
    sched.set_capacity(num_blocks)
    return sched, ReplicaBlockManager(num_blocks, config.block_size, config.prefix_caching,
                                      group_windows=config.kv_group_windows)


def make_request(rng: random.Random, index: int, config: SchedulerConfig,
                 prefixes: list[list[int]]) -> tuple[Request, Request]:
    prompt = rng.choice(prefixes)[:rng.randint(1, 12)] + [
        rng.randint(10, 500) for _ in range(rng.randint(1, 20))]
    sampling = SamplingParams(
        max_tokens=rng.randint(1, 30), min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=(STOP_ID,) if rng.random() < 0.3 else (),
        ignore_eos=rng.random() < 0.2, logprobs=1 if rng.random() < 0.2 else None,
        prompt_logprobs=0 if rng.random() < 0.1 else None)
    grammar = rng.randint(2, 8) if rng.random() < 0.15 else None
    pair = []
    for _ in range(2):
        request = Request(f"r{index}", prompt, sampling, (EOS,), config.max_model_len,
                          config.block_size, hash_blocks=config.prefix_caching,
                          frontend=index % 3, handle=index)
        if grammar is not None:
            request.grammar = CountingGrammar(grammar)  # type: ignore[assignment]
        pair.append(request)
    return pair[0], pair[1]


class SlotBook:
    """What a worker knows of slots: the request each NewRequest.slot names (the latest)."""

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}

    def expand(self, step: StepInput) -> StepInput:
        """`step` with its decode rows as the RunningRequests they stand for, without slots;
        running requests and token masks by id (the worker names both by id)."""
        for r in step.new_requests:
            self.ids[r.slot] = r.request_id
        running = list(step.running)
        if step.decodes is not None:
            slots = np.frombuffer(step.decodes.slots, dtype="<i4").tolist()
            computed = np.frombuffer(step.decodes.num_computed_tokens, dtype="<i4").tolist()
            groups = len(step.running[0].new_block_ids) if step.running else 1
            running += [RunningRequest(request_id=self.ids[slot], num_computed_tokens=c,
                                       num_new_tokens=1,
                                       new_block_ids=[[] for _ in range(groups)],
                                       new_token_ids=[])
                        for slot, c in zip(slots, computed, strict=True)]
        return replace(step, running=sorted(running, key=lambda r: r.request_id),
                       new_requests=[replace(r, slot=-1) for r in step.new_requests],
                       token_masks=sorted(step.token_masks, key=lambda m: m.request_id),
                       decodes=None)


def worker_outputs(rng: random.Random, step: StepInput, book: SlotBook,
                   ) -> tuple[StepOutput, StepOutput]:
    """A token for every request the step computes to its end (as the last stage samples),
    EOS and the stop id among them, logprobs now and then (never on a decode row: those ask
    for none): as the reference step's output, and as the compact step's."""
    rows = [] if step.decodes is None else [
        book.ids[slot] for slot in np.frombuffer(step.decodes.slots, dtype="<i4").tolist()]
    ids = [r.request_id for r in step.new_requests if r.num_new_tokens
           and r.num_computed_tokens + r.num_new_tokens == len(r.token_ids)]
    ids += [r.request_id for r in step.running]
    tokens = [rng.choice([EOS, STOP_ID] + [rng.randint(10, 500)] * 8) for _ in ids + rows]
    logprobs = [TokenLogprobs(-0.5, [t], [-0.5]) if rng.random() < 0.3 else None
                for t in tokens[:len(ids)]]
    reference = StepOutput(step.step_id, "w", ids + rows, tokens,
                           logprobs + [None] * len(rows), StepTimings(0, 0, 0, 0))
    compact = StepOutput(step.step_id, "w", ids, tokens[:len(ids)], logprobs,
                         StepTimings(0, 0, 0, 0),
                         decode_token_ids=np.asarray(tokens[len(ids):], "<i4").tobytes())
    return reference, compact


@pytest.fixture(autouse=True)
def stopped_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twins' finish records carry their phase times: one instant for both to compare."""
    monkeypatch.setattr("scheduler_svc.engine.request.clock", lambda: 100.0)


@pytest.mark.parametrize("seed", range(6))
def test_update_packed_equals_update_on_random_steps(seed: int) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=rng.choice([4, 8, 16]),
                             max_num_batched_tokens=rng.choice([16, 48, 256]),
                             block_size=BLOCK_SIZE, max_model_len=256,
                             chunked_prefill=rng.random() < 0.8)
    num_blocks = rng.choice([24, 40, 400])           # the small ones preempt
    async_scheduling = rng.random() < 0.5
    ref, ref_kv = twin(config, num_blocks, async_scheduling=async_scheduling,
                       compact_decodes=False)
    fast, fast_kv = twin(config, num_blocks, async_scheduling=async_scheduling)
    book = SlotBook()
    num_rows = 0
    prefixes = [[rng.randint(10, 500) for _ in range(12)] for _ in range(3)]
    in_flight: list[tuple[StepOutput, StepOutput]] = []
    num_added = num_finished = 0
    for _ in range(400):
        if rng.random() < 0.3 and num_added < 60:
            a, b = make_request(rng, num_added, config, prefixes)
            num_added += 1
            try:
                ref.add_request(a)
            except ValueError:
                with pytest.raises(ValueError):
                    fast.add_request(b)
                continue
            fast.add_request(b)
        if rng.random() < 0.05 and ref.requests:
            victim = rng.choice(sorted(ref.requests))
            assert (ref.abort(victim) is None) == (fast.abort(victim) is None)
        plan_a, plan_b = ref.schedule(), fast.schedule()
        assert plan_a == plan_b
        reply_a = None if plan_a is None else ref_kv.apply(plan_a)
        reply_b = None if plan_b is None else fast_kv.apply(plan_b)
        assert reply_a == reply_b
        step_a, step_b = ref.apply_plan(reply_a), fast.apply_plan(reply_b)
        assert (step_a is None) == (step_b is None)
        if step_a is not None and step_b is not None:
            assert book.expand(step_a) == book.expand(step_b)
            num_rows += 0 if step_b.decodes is None else len(step_b.decodes.slots) // 4
            in_flight.append(worker_outputs(rng, step_b, book))
        # Outputs come back one step late under async scheduling, at once otherwise.
        while in_flight and (len(in_flight) > 1 or not async_scheduling
                             or rng.random() < 0.5):
            output_a, output_b = in_flight.pop(0)
            expected = pack_outputs(ref.update(output_a), 0, 7)
            packer = StepPacker()
            fast.update_packed(output_b, packer)
            assert packer.messages(0, 7) == expected
            num_finished += sum(len(m.finished) for m in expected.values())
        assert sorted(ref.requests) == sorted(fast.requests)
        assert [r.request_id for r in ref.running] == [r.request_id for r in fast.running]
        for rid, a in ref.requests.items():
            b = fast.requests[rid]
            assert (a.token_ids, a.num_computed_tokens, a.block_hashes, a.status) == (
                b.token_ids, b.num_computed_tokens, b.block_hashes, b.status), rid
        assert ref.num_free_blocks == fast.num_free_blocks
        # A slot names one request the workers hold, and only while they hold it.
        slots = [r.slot for r in fast.requests.values() if r.slot >= 0]
        assert len(slots) == len(set(slots))
        assert all(r.on_worker == (r.slot >= 0) for r in fast.requests.values())
    assert num_finished > 10
    assert num_rows > 50           # the compact rows were exercised


def test_no_rows_for_logprobs_or_pipeline_ranks() -> None:
    """A request that asks for logprobs decodes as a RunningRequest (its logprobs ride with
    its id); with PP > 1 (tokens shipped to non-last ranks) no step has rows."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=BLOCK_SIZE,
                             max_model_len=256)
    for ship in (False, True):
        sched, kv = twin(config, 64, ship_sampled_tokens=ship)
        for i, logprobs in enumerate((None, 1)):
            sched.add_request(Request(f"r{i}", [11, 12, 13], SamplingParams(
                max_tokens=8, logprobs=logprobs, ignore_eos=True), (EOS,), 256, BLOCK_SIZE,
                hash_blocks=False))
        rows_of: list[list[str]] = []
        for _ in range(5):
            plan = sched.schedule()
            step = sched.apply_plan(None if plan is None else kv.apply(plan))
            assert step is not None
            slots = [] if step.decodes is None else np.frombuffer(step.decodes.slots,
                                                                  "<i4").tolist()
            by_slot = {r.slot: rid for rid, r in sched.requests.items()}
            rows_of.append([by_slot[slot] for slot in slots])
            running = [r.request_id for r in step.running]
            out = StepOutput(step.step_id, "w", [r.request_id for r in step.new_requests]
                             + running, [20] * (len(step.new_requests) + len(running)),
                             [None] * (len(step.new_requests) + len(running)),
                             StepTimings(0, 0, 0, 0),
                             decode_token_ids=np.full(len(slots), 21, "<i4").tobytes())
            sched.update(out)
        # r0 is a row in every step but the one that gives it a new block; r1 never.
        assert rows_of[1:] == ([["r0"], [], ["r0"], ["r0"]] if not ship else [[]] * 4)
