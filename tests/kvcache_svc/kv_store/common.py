"""Chunks for the KV store tests: distinct keys, data that differs per chunk."""

import hashlib

from services.kv_chunks import KvChunk, KvSlice, make_chunk
from services.kv_store_wire import ChunkKey

SLICE = KvSlice("test-model", "float16", layer_start=0, layer_end=2, head_start=0, head_end=4)
CHUNK_TOKENS = 16


def block_hash(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def key(i: int, num_tokens: int = CHUNK_TOKENS, kv_slice: KvSlice = SLICE) -> ChunkKey:
    return kv_slice.key(block_hash(i), num_tokens)


def chunk(i: int, num_elements: int = 512, num_tokens: int = CHUNK_TOKENS) -> KvChunk:
    """Chunk i: `num_elements` float16 values (2 bytes each) whose bytes depend on i."""
    data = hashlib.shake_256(b"data %d" % i).digest(num_elements * 2)
    return make_chunk(key(i, num_tokens), (1, num_elements), data)

