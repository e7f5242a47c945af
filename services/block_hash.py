"""Chained block hashes: the prefix-cache key shared by scheduler_svc and kvcache_svc.

The hash of block i covers the hash of block i-1, the block's token ids and extra keys (a cache
salt), so equal hashes mean equal prefixes. The scheduler computes them (it owns the tokens);
kvcache_svc only stores and looks them up. 64-bit BLAKE2b, stable across processes.
"""

import hashlib
import struct
from collections.abc import Sequence

NONE_HASH = 0  # parent hash of the first block


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_key: bytes = b"") -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(extra_key)
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent_hash: int = NONE_HASH,
                     start_block: int = 0, extra_key: bytes = b"") -> list[int]:
    """Hashes of the full blocks from `start_block` on; `parent_hash` is block start_block-1's."""
    hashes: list[int] = []
    for begin in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[begin:begin + block_size], extra_key)
        hashes.append(parent_hash)
    return hashes
