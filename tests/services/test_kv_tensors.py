"""Tensors to chunks and back, over a real store socket: bit-exact for every KV dtype."""

from collections.abc import Iterator

import pytest
import torch
import zmq

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services.kv_chunks import KvChunk, KvSlice
from services.kv_store_client import KvStoreClient, SaveResult
from services.kv_tensors import (
    TORCH_DTYPES,
    chunk_from_tensor,
    load_tensors,
    save_tensors,
    tensor_from_chunk,
)
from tests.kvcache_svc.kv_store.common import CHUNK_TOKENS, block_hash
from tests.kvcache_svc.kv_store.serving import client_codec, serving

SHAPE = (2, 2, CHUNK_TOKENS, 4, 8)   # [layers, k/v, tokens, kv heads, head dim]


@pytest.fixture
def client() -> Iterator[KvStoreClient]:
    ctx = zmq.Context()
    store = KvStore([MemoryTier(1 << 24)], chunk_tokens=CHUNK_TOKENS)
    with serving(ctx, store) as loop:
        rpc = KvStoreClient(ctx, loop.address, codec=client_codec())
        yield rpc
        rpc.close()
    ctx.term()


def random_bits(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern is fair game (NaN payloads, -0, infinities, subnormals): the store
    moves bytes and must not touch a single one."""
    gen = torch.Generator().manual_seed(seed)
    num_bytes = torch.Size(SHAPE).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(SHAPE)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_round_trip_is_bit_exact(client: KvStoreClient, dtype: str) -> None:
    kv_slice = KvSlice("m", dtype, 0, 2, 0, 4)
    keys = [kv_slice.key(block_hash(i), CHUNK_TOKENS) for i in range(3)]
    tensors = [random_bits(TORCH_DTYPES[dtype], seed) for seed in range(3)]
    assert save_tensors(client, list(zip(keys, tensors))) == SaveResult(3, 0, 0)
    loaded = load_tensors(client, [*keys, kv_slice.key(block_hash(9), CHUNK_TOKENS)])
    assert loaded[3] is None
    for want, got in zip(tensors, loaded[:3]):
        assert got is not None and same_bits(want, got)


def test_a_non_contiguous_tensor_is_saved_as_its_values(client: KvStoreClient) -> None:
    kv_slice = KvSlice("m", "float32", 0, 2, 0, 4)
    base = random_bits(torch.float32, 5)
    strided = base.transpose(0, 1)
    assert not strided.is_contiguous()
    key = kv_slice.key(block_hash(0), CHUNK_TOKENS)
    save_tensors(client, [(key, strided)])
    got = load_tensors(client, [key])[0]
    assert got is not None and same_bits(strided, got)


def test_the_chunk_shares_a_contiguous_tensors_memory() -> None:
    tensor = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    chunk = chunk_from_tensor(KvSlice("m", "float16", 0, 1, 0, 1).key(bytes(32), 16), tensor)
    assert chunk.header.shape == (3, 4) and chunk.num_bytes == 24
    tensor[0, 0] = 7.0
    assert bytes(chunk.data[:2]) == torch.tensor([7.0], dtype=torch.float16).numpy().tobytes()


def test_read_only_data_becomes_a_tensor_of_its_own() -> None:
    tensor = random_bits(torch.bfloat16, 1)
    chunk = chunk_from_tensor(KvSlice("m", "bfloat16", 0, 2, 0, 4).key(bytes(32), 16), tensor)
    frozen = KvChunk(chunk.header, bytes(chunk.data))
    assert same_bits(tensor_from_chunk(frozen), tensor)


def test_wrong_tensors_are_refused() -> None:
    key = KvSlice("m", "float16", 0, 1, 0, 1).key(bytes(32), 16)
    with pytest.raises(ValueError, match="tensor of torch.float32 for a chunk of float16"):
        chunk_from_tensor(key, torch.zeros(4))
    with pytest.raises(ValueError, match="host memory"):
        chunk_from_tensor(key, torch.zeros(4, dtype=torch.float16, device="meta"))
