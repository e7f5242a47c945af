"""Tensor parallelism: the shard arithmetic, 4-bit slices, and two TP ranks (real processes,
gloo) running the real model step by step to the tokens one rank gives."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from services.model_config import ModelConfig, load_model_config
from services.wire import StepOutput
from tests.worker_svc.common import PROMPTS
from tests.worker_svc.test_runner import BLOCK_SIZE, NUM_BLOCKS, MiniScheduler
from worker_svc.kernels import load_cpu_kernels
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.quant_blocks import QuantBlocks
from worker_svc.model.llama import Linear
from worker_svc.model.tensor_parallel import (
    TpShard,
    slice_quant_cols,
    slice_quant_rows,
    split_sizes,
)
from worker_svc.runner import ModelRunner


def test_split_sizes() -> None:
    assert split_sizes(9, 2) == [5, 4]
    assert split_sizes(1536, 2, 32) == [768, 768]
    assert split_sizes(96, 2, 32) == [64, 32]       # whole 32-groups, first rank larger
    assert split_sizes(50, 3, 32) == [17, 17, 16]   # 50 is not a multiple of 32: unit 1


@pytest.mark.parametrize("heads, kv_heads, tp", [
    (9, 3, 1), (9, 3, 2), (9, 3, 3), (9, 3, 4), (9, 3, 5), (9, 3, 9), (32, 8, 4), (32, 8, 16),
    (8, 1, 3), (12, 12, 5),
])
def test_heads_cover_the_model_once_with_uniform_groups(heads: int, kv_heads: int,
                                                        tp: int) -> None:
    group = heads // kv_heads
    shards = [TpShard.build(r, tp, heads, kv_heads, 1536, 49152) for r in range(tp)]
    # Every query head is on exactly one rank, in order.
    assert [h for s in shards for h in range(*s.q_heads)] == list(range(heads))
    for s in shards:
        assert s.num_heads >= 1 and s.num_heads % s.num_kv_heads == 0
        # A rank's KV heads are exactly the ones its query heads read.
        assert s.kv_heads == (s.q_heads[0] // group, (s.q_heads[1] - 1) // group + 1)
        if s.num_kv_heads > 1:
            assert s.num_heads == s.num_kv_heads * group
    # Replication only when there are more ranks than KV heads.
    kv_total = sum(s.num_kv_heads for s in shards)
    assert kv_total == (kv_heads if tp <= kv_heads else tp)
    assert [i for s in shards for i in range(*s.intermediate)] == list(range(1536))
    assert [i for s in shards for i in range(*s.vocab)] == list(range(49152))


def test_smollm2_on_two_ranks() -> None:
    a, b = (TpShard.build(r, 2, 9, 3, 1536, 49152) for r in range(2))
    assert (a.q_heads, a.kv_heads, b.q_heads, b.kv_heads) == ((0, 6), (0, 2), (6, 9), (2, 3))
    assert (a.intermediate, b.intermediate) == ((0, 768), (768, 1536))


def test_too_many_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the model's 9 attention heads"):
        TpShard.build(0, 10, 9, 3, 1536, 49152)


def _random_q4(out_features: int, in_features: int) -> QuantBlocks:
    g = torch.Generator().manual_seed(0)
    groups = in_features // 32
    return QuantBlocks(torch.randint(0, 16, (out_features, in_features), generator=g,
                                     dtype=torch.uint8),
                       torch.rand(out_features, groups, generator=g) * 0.01,
                       torch.randn(out_features, groups, generator=g) * 0.01, 4)


def _dense(blocks: QuantBlocks, dtype: torch.dtype) -> torch.Tensor:
    scales = blocks.scales.repeat_interleave(32, dim=1)
    offsets = blocks.offsets.repeat_interleave(32, dim=1)
    return (scales * blocks.values.float() + offsets).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_slices_give_the_slices_of_the_product(dtype: torch.dtype) -> None:
    kernels = load_cpu_kernels(detect_level(), 64, 1, dtype)
    blocks = _random_q4(96, 128)
    x = torch.randn(3, 128).to(dtype)
    linear = Linear([_dense(blocks, dtype)], [blocks], kernels)
    if detect_level() >= CpuLevel.AVX2:
        assert linear.quant is not None and linear.quant_max_rows >= 3   # the blocks' path
    full = linear(x).float()
    # Column-parallel: rows 32..96 of the weight give columns 32..96 of the output.
    rows = slice_quant_rows(blocks, 32, 96)
    part = Linear([_dense(rows, dtype)], [rows], kernels)(x).float()
    torch.testing.assert_close(part, full[:, 32:96], rtol=0, atol=0)
    # Row-parallel: two input halves add up to the product (up to rounding of the sum).
    halves = [slice_quant_cols(blocks, 0, 64), slice_quant_cols(blocks, 64, 128)]
    total = sum(Linear([_dense(h, dtype)], [h], kernels)(x[:, i * 64:(i + 1) * 64].contiguous())
                .float() for i, h in enumerate(halves))
    torch.testing.assert_close(total, full, rtol=2e-2, atol=2e-2)
    assert slice_quant_cols(blocks, 0, 48) is None    # a cut inside a 32-block: dense only


# ------------------------------------------------------------------- two ranks, real processes


def _run_rank(tp_rank: int, tp_size: int, port: int, model_path: str, result_dir: str,
              kv_cache_dtype: str = "auto") -> None:
    from worker_svc.model.tensor_parallel import TpGroup
    from worker_svc.parallel import ParallelGroups

    torch.set_num_threads(1)
    config = load_model_config(model_path)
    groups = ParallelGroups(f"tcp://127.0.0.1:{port}", 0, 1, tp_rank, tp_size, timeout_s=60)
    shard = TpShard.build(tp_rank, tp_size, config.num_heads, config.num_kv_heads,
                          config.intermediate_size, config.vocab_size)
    assert groups.tp_group is not None
    runner = ModelRunner(config, model_path, torch.float32, f"tp{tp_rank}",
                         tp=TpGroup(groups.tp_group, shard), kv_cache_dtype=kv_cache_dtype)
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    tokens = _generate(runner)
    Path(result_dir, f"rank{tp_rank}.json").write_text(json.dumps(tokens))
    groups.close()


def _generate(runner: ModelRunner) -> dict[str, list[int]]:
    # Several prefill chunks; steady decodes as compact rows (services.wire.DecodeRows).
    scheduler = MiniScheduler(token_budget=7, send_tokens=False, compact=True)
    for name in ("The capital of France is", "Once upon a time, in a small village,"):
        scheduler.add(name, PROMPTS[name], 10)
    while scheduler.has_work:
        output = runner.execute(scheduler.schedule())
        assert isinstance(output, StepOutput)
        scheduler.update(output)
    return {name: scheduler.outputs(name) for name in scheduler.requests}


@pytest.fixture(scope="module")
def single_rank_tokens(model_path: Path, model_config: ModelConfig) -> dict[str, list[int]]:
    single = ModelRunner(model_config, model_path, torch.float32, "tp-none")
    single.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    return _generate(single)


# tp=2: SmolLM2's 3 KV heads split 2 + 1 (uneven, no replication); tp=4: more ranks than KV
# heads, so KV head 0 is replicated on two ranks that split its query group.
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_ranks_give_the_tokens_of_one(model_path: Path, tmp_path: Path, tp_size: int,
                                         single_rank_tokens: dict[str, list[int]]) -> None:
    from tests.e2e.harness import free_ports

    port = free_ports(1)[0]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_run_rank, args=(tp_size, port, str(model_path), str(tmp_path)),
                       nprocs=tp_size, start_method="spawn")
    for rank in range(tp_size):
        tokens = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert tokens == single_rank_tokens, rank


def test_tp_ranks_with_an_fp8_cache_give_the_tokens_of_one(model_path: Path,
                                                           model_config: ModelConfig,
                                                           tmp_path: Path) -> None:
    """An 8-bit cache means the same under TP (issue 39): each rank stores its KV heads with
    the replica's per-tensor scales, so two ranks give one fp8 rank's tokens."""
    from tests.e2e.harness import free_ports

    single = ModelRunner(model_config, model_path, torch.float32, "tp-none-fp8",
                         kv_cache_dtype="fp8")
    single.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    expected = _generate(single)
    single.close()
    port = free_ports(1)[0]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_run_rank, args=(2, port, str(model_path), str(tmp_path), "fp8"),
                       nprocs=2, start_method="spawn")
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank


# ------------------------------------------------------------------- a peer dies mid-step


def _survive_a_lost_peer(rank: int, port: int, result_dir: str, pp_size: int,
                         tp_size: int) -> None:
    """Rank 1 leaves as a killed process would (no goodbye); rank 0's next collective with
    it must raise PeerLost, which the worker reports so the scheduler moves the requests."""
    from worker_svc.model.tensor_parallel import TpGroup
    from worker_svc.parallel import ParallelGroups, PeerLost

    pp_rank, tp_rank = divmod(rank, tp_size)
    groups = ParallelGroups(f"tcp://127.0.0.1:{port}", pp_rank, pp_size, tp_rank, tp_size,
                            timeout_s=30)
    if rank == 1:
        os._exit(0)
    try:
        if tp_size > 1:
            assert groups.tp_group is not None
            shard = TpShard.build(0, tp_size, 4, 2, 64, 100)
            TpGroup(groups.tp_group, shard).all_reduce(torch.ones(8))
        else:
            groups.send(torch.ones(4, 8), torch.ones(4, 8))
            groups.send(torch.ones(4, 8), torch.ones(4, 8))   # a dead peer can buffer one
        outcome = "no error"
    except PeerLost as exc:
        outcome = f"PeerLost: {exc}"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    Path(result_dir, "rank0.txt").write_text(outcome)
    os._exit(0)     # the group cannot be torn down with a peer gone


@pytest.mark.parametrize("pp_size, tp_size", [(2, 1), (1, 2)], ids=["pp-send", "tp-all-reduce"])
def test_a_collective_with_a_dead_peer_raises_peer_lost(tmp_path: Path, pp_size: int,
                                                        tp_size: int) -> None:
    from tests.e2e.harness import free_ports

    port = free_ports(1)[0]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_survive_a_lost_peer, args=(port, str(tmp_path), pp_size, tp_size),
                       nprocs=2, start_method="spawn")
    outcome = (tmp_path / "rank0.txt").read_text()
    assert outcome.startswith("PeerLost: "), outcome
    assert "pipeline rank 1" in outcome or "TP all-reduce" in outcome, outcome
