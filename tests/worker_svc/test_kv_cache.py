"""KV-cache sizing and allocation."""

import pytest
import torch

from worker_svc.kv_cache import (
    KvLayerSpec,
    allocate_kv_caches,
    bytes_per_block,
    num_blocks_for_budget,
)


def test_page_bytes_and_budget() -> None:
    bf16 = KvLayerSpec(block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    fp32 = KvLayerSpec(block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    assert bf16.page_bytes == 2 * 16 * 3 * 64 * 2
    assert bytes_per_block([bf16, fp32]) == bf16.page_bytes + fp32.page_bytes
    per_block = bytes_per_block([bf16] * 30)
    assert num_blocks_for_budget(100 * per_block + per_block - 1, [bf16] * 30) == 100
    assert num_blocks_for_budget(-5, [bf16]) == 0
    with pytest.raises(ValueError, match="block size"):
        num_blocks_for_budget(1 << 20, [bf16, KvLayerSpec(8, 3, 64, torch.bfloat16)])


def test_allocate_one_zeroed_tensor_per_layer() -> None:
    spec = KvLayerSpec(block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    caches = allocate_kv_caches([spec, spec], num_blocks=5)
    assert len(caches) == 2 and caches[0].data_ptr() != caches[1].data_ptr()
    assert caches[0].shape == (2, 5, 4, 2, 8) and caches[0].dtype == torch.bfloat16
    assert not caches[0].any()
    with pytest.raises(ValueError, match="null block"):
        allocate_kv_caches([spec], num_blocks=1)
