"""A KV store whose disk tier takes 500 ms per chunk read or written (injected through
SPLITSERVE_TEST_KV_DISK_DELAY_MS; the memory tier is too small for a chunk, so every save and
load goes to disk), across real processes (issue 24, point 3): while a long prompt's chunks are
written, another request is admitted and decoded with the oracle's tokens, no plan call times
out (no kvcache recovery), and the chunks all land on disk."""

import time
from pathlib import Path

import pytest

from tests.e2e.harness import (
    assert_matches_reference,
    greedy_request,
    run_cluster,
    stream_tokens,
    wait_for,
)
from tests.e2e.test_kv_store import document_prompt, replica_info

pytestmark = pytest.mark.e2e


def test_a_slow_disk_holds_up_no_admission_and_no_plan_call(
        tmp_path: Path, tokenizer, oracle) -> None:  # type: ignore[no-untyped-def]
    long_prompt = document_prompt(tokenizer, "What does a CPU do?")
    short_prompt = document_prompt(tokenizer, "Name a colour.", 1, title="Part")[:120]
    ref, margins = oracle.greedy(short_prompt, 8)
    env = {"SPLITSERVE_KV_STORE_DIR": str(tmp_path / "store"),
           "SPLITSERVE_KV_STORE_MEMORY_GIB": "0.001",
           "SPLITSERVE_TEST_KV_DISK_DELAY_MS": "500"}
    with run_cluster(tmp_path / "logs", env=env) as cluster:
        long_run = cluster.stub.Generate(greedy_request(long_prompt, 30), timeout=300)
        next(iter(long_run))                  # prefilled: its chunks go to the slow disk now
        began = time.monotonic()
        short, _, _ = stream_tokens(cluster.stub, greedy_request(short_prompt, 8))
        elapsed = time.monotonic() - began
        assert_matches_reference(short, ref, margins, "short request beside slow saves")
        for _ in long_run:
            pass
        num_chunks = len(long_prompt) // 256 + 1             # whole chunks and the tail
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_chunks >= num_chunks, 30)
        for replica in replica_info(cluster):
            assert replica.num_kv_recoveries == 0, replica   # no plan call timed out
        disk = next(t for t in cluster.kv_stats().store.tiers if t.name == "disk")
        assert disk.num_chunks >= num_chunks
    print(f"short request beside slow saves: {elapsed:.2f} s")
