"""KV store chunks: how a request's KV is cut into chunks and keyed, and how a chunk's data is
checked against its header.

Shared by the worker (it saves and loads chunks), the scheduler (it looks them up) and
kvcache_svc (it stores them). No torch here: `services.kv_tensors` turns tensors into chunks.

Chunk i of a request covers tokens [i * chunk_tokens, (i + 1) * chunk_tokens) and is keyed by
the chained hash of its last block (`services.block_hash`), so a chunk only ever matches after
its exact prefix. Only full blocks have hashes: a tail shorter than a chunk is left out unless
asked for (`with_partial_tail`), and then it is a chunk of its own length, keyed by its own last
block, which a longer prompt never asks for (its chunk there ends later). Saving is incremental:
a request's leading chunks already held (`skip_leading_tokens`) are not sent again.
"""

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.kv_store_wire import (
    CHUNK_CHECKSUM_BYTES,
    KV_DTYPE_BYTES,
    ChunkHeader,
    ChunkKey,
    KvSlice,
)


def chunk_checksum(data: bytes | memoryview) -> bytes:
    """BLAKE2b-256 of a chunk's data frame (hashlib releases the GIL while it hashes)."""
    return hashlib.blake2b(data, digest_size=CHUNK_CHECKSUM_BYTES).digest()


def chunk_num_bytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * KV_DTYPE_BYTES[dtype]


@dataclass(frozen=True, slots=True)
class KvChunk:
    """A chunk's header and its data frame. Built by `make_chunk` or, for received or read
    data, only once `chunk_problem` found nothing: the data always matches the header."""

    header: ChunkHeader
    data: bytes | memoryview    # exactly header.num_bytes; never written while the chunk lives

    @property
    def key(self) -> ChunkKey:
        return self.header.key

    @property
    def num_bytes(self) -> int:
        return self.header.num_bytes


def make_chunk(key: ChunkKey, shape: Sequence[int], data: bytes | memoryview) -> KvChunk:
    """The chunk of `data` (C order, `key.dtype` elements of `shape`), its checksum computed."""
    if not shape or min(shape) < 1:
        raise ValueError(f"a chunk's shape needs at least one dimension, none empty: {shape}")
    header = ChunkHeader(key, tuple(shape), chunk_num_bytes(shape, key.dtype),
                         chunk_checksum(data))
    if len(data) != header.num_bytes:
        raise ValueError(f"{len(data)} bytes of data for shape {list(shape)} of {key.dtype} "
                         f"({header.num_bytes} bytes)")
    return KvChunk(header, data)


def chunk_problem(header: ChunkHeader, data: bytes | memoryview) -> str | None:
    """Why `data` is not the chunk `header` describes, or None. Sizes first (cheap, and what a
    truncated frame or file fails), then the checksum."""
    expected = chunk_num_bytes(header.shape, header.key.dtype)
    if header.num_bytes != expected:
        return (f"header says {header.num_bytes} bytes, but shape {list(header.shape)} of "
                f"{header.key.dtype} is {expected}")
    if len(data) != header.num_bytes:
        return f"data of {len(data)} bytes, header says {header.num_bytes}"
    if chunk_checksum(data) != header.checksum:
        return "checksum mismatch"
    return None


def chunk_token_ends(num_full_blocks: int, block_size: int, chunk_tokens: int,
                     with_partial_tail: bool = False) -> list[int]:
    """Where each chunk ends (token counts) over a request's full blocks."""
    if block_size < 1 or chunk_tokens < block_size or chunk_tokens % block_size:
        raise ValueError(f"chunk_tokens ({chunk_tokens}) must be a positive multiple of "
                         f"block_size ({block_size})")
    num_tokens = num_full_blocks * block_size
    ends = list(range(chunk_tokens, num_tokens + 1, chunk_tokens))
    if with_partial_tail and num_tokens % chunk_tokens:
        ends.append(num_tokens)
    return ends


def chunk_keys(block_hashes: Sequence[bytes], block_size: int, chunk_tokens: int,
               kv_slice: KvSlice, with_partial_tail: bool = False) -> list[ChunkKey]:
    """The keys of a request's chunks, in order, from the hashes of its full blocks."""
    keys: list[ChunkKey] = []
    start = 0
    for end in chunk_token_ends(len(block_hashes), block_size, chunk_tokens,
                                with_partial_tail):
        keys.append(kv_slice.key(block_hashes[end // block_size - 1], end - start))
        start = end
    return keys


def skip_leading_tokens(keys: Sequence[ChunkKey], num_held_chunks: int) -> int:
    """Tokens covered by the first `num_held_chunks` keys: what a save need not send again."""
    return sum(key.num_tokens for key in keys[:num_held_chunks])


def stored_message(num_stored_tokens: int, num_tokens: int, skip_leading: int) -> str:
    return (f"stored KV for {num_stored_tokens} of {num_tokens} tokens "
            f"(skip_leading_tokens={skip_leading})")


def log_stored(logger: logging.Logger, num_stored_tokens: int, num_tokens: int,
               skip_leading: int) -> None:
    """The worker's line after a save: how much of a request's KV it sent, and how much it
    skipped because the store already held it."""
    logger.info("%s", stored_message(num_stored_tokens, num_tokens, skip_leading))
