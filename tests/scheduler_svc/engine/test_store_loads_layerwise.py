"""Layer-wise KV loads (issue 24, point 2) as kvcache_svc admits them and the scheduler tracks
them: the load's step also computes the rest of the prompt and samples its first token; the
ranks' reports and that step's output may come in either order; a short load samples nothing
and the request goes on from what every rank loaded. Real block manager over a StoreView of a
real in-memory KvStore; outputs and KvLoaded reports are hand-made (what the workers send:
worker_svc.kv_loader.settle_inline_loads makes every rank report the agreed count)."""

import pytest

from kvcache_svc.block_manager import ReplicaBlockManager
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.view import StoreView
from scheduler_svc.engine.request import FinishReason
from services.block_hash import hash_full_blocks
from services.kv_wire import AdmitOp, PlanRequest
from tests.scheduler_svc.engine.test_store_loads import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    PROMPT,
    SLICES,
    loaded,
    make_request,
    output,
    put_chunks,
    run_step,
    with_store,
)


def test_the_loads_step_computes_the_rest_of_the_prompt() -> None:
    sched, kv, request = with_store(layerwise=True)
    step = run_step(sched, kv)
    [new] = step.new_requests
    assert (new.num_computed_tokens, new.num_load_tokens, new.num_new_tokens) == (0, 512, 88)
    assert len(new.block_ids[0]) == -(-600 // BLOCK_SIZE)        # blocks for the whole prompt
    # In flight twice (its step, its load); it samples in this step; the loaded and computed
    # blocks are not in the prefix index until every rank reported.
    assert (request.num_computed_tokens, request.num_in_flight, request.num_pending_tokens) == (
        600, 2, 1)
    assert request.num_committed_blocks == 0 and kv.requests["a"].num_committed_blocks == 0
    assert request.num_cached_tokens == 512        # the client's usage, counted at once


@pytest.mark.parametrize("output_first", [True, False], ids=["output-first", "reports-first"])
def test_a_full_load_gives_its_first_token_and_goes_on(output_first: bool) -> None:
    sched, kv, request = with_store(layerwise=True)
    step = run_step(sched, kv)
    reports = loaded(step, 512, 512)
    if output_first:
        [first] = sched.update(output(step, {"a": 11}))
        assert first.new_token_ids == [11]
        assert not sched.has_schedulable()          # held until every rank reported
        sched.loads.finish(step.step_id, reports, sched.requests)
    else:
        sched.loads.finish(step.step_id, reports, sched.requests)
        [first] = sched.update(output(step, {"a": 11}))
        assert first.new_token_ids == [11]
    assert (request.num_computed_tokens, request.num_in_flight) == (600, 0)
    assert (sched.loads.num_loaded_tokens, sched.loads.num_fallbacks) == (512, 0)
    # The next step decodes and commits every full block of the prompt.
    step = run_step(sched, kv)
    [running] = step.running
    assert (running.num_computed_tokens, running.num_new_tokens) == (600, 1)
    assert request.num_committed_blocks == kv.requests["a"].num_committed_blocks == 37
    sched.update(output(step, {"a": 12}))
    [last] = sched.update(output(run_step(sched, kv), {"a": 13}))
    assert last.finish_reason is FinishReason.LENGTH and last.num_cached_tokens == 512


@pytest.mark.parametrize("output_first", [True, False], ids=["output-first", "reports-first"])
@pytest.mark.parametrize("num_loaded", [256, 0])
def test_a_short_load_samples_nothing_and_resumes_from_what_loaded(output_first: bool,
                                                                   num_loaded: int) -> None:
    sched, kv, request = with_store(layerwise=True)
    step = run_step(sched, kv)
    reports = loaded(step, num_loaded, num_loaded)       # every rank reports the agreed count
    if output_first:
        assert sched.update(output(step)) == []          # no token for it: it was short
        assert not sched.has_schedulable()
        sched.loads.finish(step.step_id, reports, sched.requests)
    else:
        sched.loads.finish(step.step_id, reports, sched.requests)
        assert not sched.has_schedulable()               # its step is still in flight
        assert sched.update(output(step)) == []
    assert (request.num_computed_tokens, request.num_in_flight) == (num_loaded, 0)
    assert request.num_cached_tokens == request.num_store_loaded_tokens == num_loaded
    assert (sched.loads.num_loaded_tokens, sched.loads.num_fallbacks) == (num_loaded, 1)
    step = run_step(sched, kv)
    [running] = step.running
    assert (running.num_computed_tokens, running.num_new_tokens) == (num_loaded, 600 - num_loaded)
    assert running.new_block_ids == [[]]                 # its blocks cover the prompt already
    [first] = sched.update(output(step, {"a": 11}))
    assert first.new_token_ids == [11] and request.num_output_tokens == 1


def test_a_request_ending_on_its_first_token_counts_its_load() -> None:
    sched, kv, _ = with_store(add=False, layerwise=True)
    request = make_request(max_tokens=1)
    sched.add_request(request)
    step = run_step(sched, kv)
    [last] = sched.update(output(step, {"a": 11}))
    assert last.finish_reason is FinishReason.LENGTH and last.num_cached_tokens == 512
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert (sched.loads.num_loaded_tokens, sched.loads.num_fallbacks) == (512, 0)
    assert request.num_in_flight == 0


# --------------------------------------------------------------------- kvcache_svc admission

def manager(num_blocks: int = 129) -> ReplicaBlockManager:
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    put_chunks(store, PROMPT, BLOCK_SIZE, 2)
    return ReplicaBlockManager(num_blocks, BLOCK_SIZE, True,
                               store=StoreView(store, SLICES, BLOCK_SIZE))


def admit(mgr: ReplicaBlockManager, max_new: int = 4096, allow_partial: bool = True,
          ) -> tuple[int, int, int] | None:
    op = AdmitOp("a", len(PROMPT), hash_full_blocks(PROMPT, BLOCK_SIZE), max_new,
                 allow_partial, None, compute_after_load=True)
    reply = mgr.apply(PlanRequest(0, 1, [], [], [op]))
    assert reply.error is None
    if not reply.admitted:
        return None
    [result] = reply.admitted
    assert len(result.block_ids[0]) == -(-(result.num_cached_tokens + result.num_load_tokens
                                            + result.num_new_tokens) // BLOCK_SIZE)
    return result.num_cached_tokens, result.num_load_tokens, result.num_new_tokens


@pytest.mark.parametrize("max_new, allow_partial, expected", [
    (4096, True, (0, 512, 88)), (64, True, (0, 512, 64)), (88, False, (0, 512, 88)),
    (64, False, (0, 512, 0))], ids=["all", "budget-caps-the-rest", "fits-whole",
                                    "no-chunking-loads-alone"])
def test_admission_computes_after_the_load_within_the_budget(
        max_new: int, allow_partial: bool, expected: tuple[int, int, int]) -> None:
    assert admit(manager(), max_new, allow_partial) == expected


def test_under_memory_pressure_the_load_goes_alone_before_it_shrinks() -> None:
    """Blocks for the load but not the rest: the load alone; for fewer, its whole chunks
    that fit (as a background load's admission)."""
    assert admit(manager(32 + 1)) == (0, 512, 0)          # 32 usable: 38 for it all
    assert admit(manager(20 + 1)) == (0, 256, 0)
