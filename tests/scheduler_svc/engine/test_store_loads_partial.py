"""Loads of partial chunks as the scheduler sees them (issue 24): a request whose prompt the
KV store holds to its end, the last chunk partial, is admitted to load every token but its
last (the scheduler sends the hash of its exact tokens, `AdmitOp.tail_hash`), resumes after
what every rank loaded, computes one token and commits only its full blocks."""

import pytest

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.scheduler import Scheduler
from services.block_hash import hash_full_blocks
from services.kv_chunks import make_chunk, prefix_chunk_keys, prefix_hash
from tests.scheduler_svc.engine.test_store_loads import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    NUM_BLOCKS,
    SLICES,
    loaded,
    make_request,
    new_kv,
    output,
    run_step,
)


def store_all(store: KvStore, token_ids: list[int]) -> None:
    """Stores every chunk of `token_ids` for every slice, the last ending at their end."""
    hashes = hash_full_blocks(token_ids, BLOCK_SIZE)
    for kv_slice in SLICES:
        for key in prefix_chunk_keys(hashes, token_ids, 0, len(token_ids), BLOCK_SIZE,
                                     CHUNK_TOKENS, kv_slice):
            chunk = make_chunk(key, (4,), bytes(8))
            assert store.put(chunk.header, chunk.data)


def test_the_tail_hash_is_the_exact_prefix_hash() -> None:
    request = make_request(prompt=list(range(40)))
    assert request.tail_hash() == prefix_hash(request.block_hashes, request.token_ids, 40,
                                              BLOCK_SIZE)
    assert make_request(prompt=list(range(32))).tail_hash() is None    # last block full


@pytest.mark.parametrize("num_tokens", [32, 40, 300])
def test_a_prompt_held_to_its_end_loads_all_but_its_last_token(num_tokens: int) -> None:
    prompt = [5 + 11 * i % 977 for i in range(num_tokens)]
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    store_all(store, prompt)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048,
                                      block_size=BLOCK_SIZE, max_model_len=4096,
                                      layerwise_loads=False),
                      compact_decodes=False)   # outputs by id, as in common.py
    sched.set_capacity(NUM_BLOCKS)
    kv = new_kv(store)
    request = make_request(prompt=prompt)
    sched.add_request(request)

    step = run_step(sched, kv)
    [new] = step.new_requests
    assert (new.num_computed_tokens, new.num_new_tokens, new.num_load_tokens) == (
        0, 0, num_tokens - 1)
    assert sched.update(output(step)) == []
    for report in loaded(step, num_tokens - 1, num_tokens - 1):
        sched.loads.report(report)
    sched.loads.finish_reported(2, {"a": request})
    assert request.num_computed_tokens == num_tokens - 1
    assert request.num_cached_tokens == num_tokens - 1     # the client's usage
    assert request.num_store_loaded_tokens == num_tokens - 1   # its store hits

    step = run_step(sched, kv)
    [running] = step.running
    assert (running.num_computed_tokens, running.num_new_tokens) == (num_tokens - 1, 1)
    # Committed once computed: every full block, never the partial last one.
    assert request.num_committed_blocks == num_tokens // BLOCK_SIZE
    sched.update(output(step, {"a": 7}))
    assert request.token_ids[-1] == 7
