"""KV loads from the store as the scheduler sees them (scheduler_svc/store_loads.py): plans go
to kvcache_svc's real block manager over a StoreView of a real in-memory KvStore; the ranks'
KvLoaded reports are hand-made. SLICES and put_chunks are shared with the engine-level tests
(test_store_loads_engine.py) and the partial-chunk ones (test_store_loads_partial.py)."""

import pytest

from kvcache_svc.block_manager import ReplicaBlockManager
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.view import StoreView
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from scheduler_svc.engine.scheduler import Scheduler
from services.block_hash import hash_full_blocks
from services.kv_chunks import chunk_keys, make_chunk
from services.kv_store_wire import KvSlice
from services.wire import KvLoaded, StepError, StepInput, StepOutput, StepTimings
from tests.scheduler_svc.engine.common import EOS, applied

SLICES = (KvSlice("tiny", "float16", 0, 2, 0, 2), KvSlice("tiny", "float16", 0, 2, 2, 3))


def put_chunks(store: KvStore, token_ids: list[int], block_size: int, num_chunks: int,
               slices: tuple[KvSlice, ...] = SLICES) -> None:
    """Stores the first `num_chunks` chunks of `token_ids` for every slice (stand-in data)."""
    hashes = hash_full_blocks(token_ids, block_size)
    for kv_slice in slices:
        for key in chunk_keys(hashes, block_size, store.chunk_tokens, kv_slice)[:num_chunks]:
            chunk = make_chunk(key, (4,), bytes(8))
            store.put(chunk.header, chunk.data)


# --------------------------------------------------------------------------- scheduler level

BLOCK_SIZE = 16
CHUNK_TOKENS = 256
PROMPT = [3 + 7 * i % 991 for i in range(600)]   # 2 whole chunks, 37 full blocks
NUM_BLOCKS = 129


def new_kv(store: KvStore) -> ReplicaBlockManager:
    return ReplicaBlockManager(NUM_BLOCKS, BLOCK_SIZE, True,
                               store=StoreView(store, SLICES, BLOCK_SIZE))


def make_request(request_id: str = "a", prompt: list[int] = PROMPT,
                 max_tokens: int = 3) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), (EOS,), 4096,
                   BLOCK_SIZE, hash_blocks=True)


def with_store(num_chunks: int = 2, add: bool = True, layerwise: bool = False,
               ) -> tuple[Scheduler, ReplicaBlockManager, Request]:
    """A scheduler, its pool over a store holding PROMPT's first chunks, and request "a" of
    PROMPT (queued unless `add` is False). Loads in the background unless `layerwise`
    (test_store_loads_layerwise.py)."""
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    put_chunks(store, PROMPT, BLOCK_SIZE, num_chunks)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048,
                                      block_size=BLOCK_SIZE, max_model_len=4096,
                                      layerwise_loads=layerwise),
                      compact_decodes=False)   # outputs by id, as in common.py
    sched.set_capacity(NUM_BLOCKS)
    request = make_request()
    if add:
        sched.add_request(request)
    return sched, new_kv(store), request


def run_step(sched: Scheduler, kv: ReplicaBlockManager) -> StepInput:
    step = sched.apply_plan(applied(kv, sched.schedule()))
    assert step is not None
    return step


def output(step: StepInput, tokens: dict[str, int] | None = None) -> StepOutput:
    tokens = tokens or {}
    return StepOutput(step.step_id, "rank-0", list(tokens), list(tokens.values()),
                      [None] * len(tokens), StepTimings(0.0, 0.0, 0.0, 0))


def loaded(step: StepInput, *per_rank: int, request_id: str = "a") -> list[KvLoaded]:
    return [KvLoaded(f"rank-{rank}", step.step_id, [request_id], [num])
            for rank, num in enumerate(per_rank)]


def test_a_load_is_scheduled_with_nothing_to_compute_and_no_sampling() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    assert not step.running
    [new] = step.new_requests
    assert (new.num_computed_tokens, new.num_new_tokens, new.num_load_tokens) == (0, 0, 512)
    assert len(new.block_ids[0]) == 512 // BLOCK_SIZE and new.token_ids == PROMPT
    # In flight twice: its step, and its load until every rank reported it.
    assert (request.num_computed_tokens, request.num_in_flight, request.num_pending_tokens) == (
        0, 2, 0)
    assert request.num_committed_blocks == 0
    assert step.step_id in sched.loads.steps
    assert (sched.loads.num_hit_tokens, sched.loads.num_miss_tokens) == (512, 88)
    assert (sched.num_prompt_tokens_admitted, sched.num_cached_tokens_admitted) == (600, 0)
    # A token for it is not expected: a worker that sent one anyway is ignored.
    assert sched.update(output(step, {"a": 9})) == []
    assert request.token_ids == PROMPT


@pytest.mark.parametrize("per_rank, resume", [((512, 512), 512), ((512, 256), 256),
                                              ((256, 512), 256), ((0, 512), 0),
                                              ((700, 600), 512)],
                         ids=["full", "rank-1-short", "rank-0-short", "rank-0-none",
                              "over-reported-capped"])
def test_the_request_resumes_after_what_every_rank_loaded(per_rank: tuple[int, int],
                                                          resume: int) -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    assert sched.update(output(step)) == []
    sched.loads.finish(step.step_id, loaded(step, *per_rank), sched.requests)
    assert step.step_id not in sched.loads.steps
    assert request.num_computed_tokens == resume
    assert request.num_cached_tokens == resume
    assert sched.loads.num_loaded_tokens == resume
    assert sched.loads.num_fallbacks == (resume < 512)

    # The next step computes the rest from there and commits every full block.
    step = run_step(sched, kv)
    [running] = step.running
    assert (running.num_computed_tokens, running.num_new_tokens) == (resume, 600 - resume)
    assert len(running.new_block_ids[0]) == -(-600 // BLOCK_SIZE) - 512 // BLOCK_SIZE
    assert kv.requests["a"].num_committed_blocks == request.num_committed_blocks == 37
    [out] = sched.update(output(step, {"a": 11}))
    assert out.new_token_ids == [11]
    step = run_step(sched, kv)
    sched.update(output(step, {"a": 12}))
    step = run_step(sched, kv)
    [last] = sched.update(output(step, {"a": 13}))
    assert last.finish_reason is FinishReason.LENGTH
    assert last.num_cached_tokens == resume


@pytest.mark.parametrize("reports", ["none", "other-request", "one-rank-silent"])
def test_a_rank_that_does_not_name_the_request_loaded_nothing(reports: str) -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    sched.update(output(step))
    given = {"none": [],
             "other-request": [loaded(step, 512)[0], KvLoaded("rank-1", step.step_id, ["x"],
                                                              [512])],
             "one-rank-silent": [loaded(step, 512)[0], KvLoaded("rank-1", step.step_id, [],
                                                                [])]}[reports]
    sched.loads.finish(step.step_id, given, sched.requests)
    assert request.num_computed_tokens == 0
    assert (sched.loads.num_loaded_tokens, sched.loads.num_fallbacks) == (0, 1)
    [running] = run_step(sched, kv).running
    assert (running.num_computed_tokens, running.num_new_tokens) == (0, 600)


def test_a_request_aborted_while_loading_is_left_alone() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    final_output = sched.abort("a")
    assert final_output is not None and final_output.finish_reason is FinishReason.ABORT
    # The same id comes back as a new request before the load's reports do.
    again = make_request()
    sched.add_request(again)
    sched.update(output(step))
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.status is RequestStatus.FINISHED and request.num_computed_tokens == 0
    assert again.status is RequestStatus.WAITING and again.num_computed_tokens == 0
    assert (sched.loads.num_loaded_tokens, sched.loads.num_fallbacks) == (0, 0)
    assert step.step_id not in sched.loads.steps


def test_a_failed_step_forgets_its_loads() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    failed, poisoned = sched.fail_step(step.step_id, StepError("boom", kv_written=False))
    assert [o.request_id for o in failed] == ["a"] and failed[0].error is not None
    assert not poisoned           # a load commits only device hits: no block without KV
    assert step.step_id not in sched.loads.steps
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert sched.loads.num_loaded_tokens == 0 and request.num_computed_tokens == 0


def test_preempt_all_forgets_every_load() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    sched.preempt_all()
    assert step.step_id not in sched.loads.steps
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.num_computed_tokens == 0 and sched.loads.num_loaded_tokens == 0


def test_a_load_shares_a_step_with_a_decode() -> None:
    sched, kv, request = with_store(add=False)
    sched.add_request(make_request("b", list(range(5, 25)), max_tokens=5))
    step = run_step(sched, kv)
    sched.update(output(step, {"b": 30}))
    sched.add_request(request)
    step = run_step(sched, kv)
    assert [(r.request_id, r.num_new_tokens) for r in step.running] == [("b", 1)]
    assert [(r.request_id, r.num_new_tokens, r.num_load_tokens)
            for r in step.new_requests] == [("a", 0, 512)]
    [out] = sched.update(output(step, {"b": 31}))
    assert out.request_id == "b" and out.new_token_ids == [31]
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.num_computed_tokens == 512
    step = run_step(sched, kv)
    assert {r.request_id: (r.num_computed_tokens, r.num_new_tokens) for r in step.running} == {
        "b": (21, 1), "a": (512, 88)}


def test_nothing_stored_means_no_load_and_no_reports() -> None:
    sched, kv, request = with_store(num_chunks=0)
    step = run_step(sched, kv)
    [new] = step.new_requests
    assert (new.num_new_tokens, new.num_load_tokens) == (600, 0)
    assert step.step_id not in sched.loads.steps
    assert (sched.loads.num_hit_tokens, sched.loads.num_miss_tokens) == (0, 600)


def test_a_readmission_after_preemption_does_not_inflate_the_cached_tokens() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    sched.update(output(step))
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.num_cached_tokens == 512
    # kvcache_svc lost the pool: every request recomputes, in a fresh pool over the same store.
    sched.preempt_all()
    kv = new_kv(kv.store.store)      # type: ignore[union-attr]
    step = run_step(sched, kv)
    assert step.new_requests[0].num_load_tokens == 512
    sched.update(output(step))
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.num_computed_tokens == 512
    assert request.num_cached_tokens <= request.num_prompt_tokens
    assert request.num_cached_tokens == 512
