"""Chained block hashes: the prefix-cache key shared by scheduler_svc and kvcache_svc.

The hash of block i covers the hash of block i-1 and the block's token ids, so equal hashes mean
equal prefixes. The scheduler computes them (it owns the tokens); kvcache_svc only stores and
looks them up, and publishes them in its KV events and `PrefixQuery` answers.

A request's optional cache salt (a tenant's secret, from the public API) enters the first
block's hash only; since every later hash chains the one before, all of that request's hashes
differ from an unsalted or differently salted request's, while requests with the same salt
still share every block. Without the salt, anyone who can read the KV events or send a
`PrefixQuery` could hash a guessed prompt and confirm that another client sent it.

SHA-256 (32-byte digests), as vLLM uses. The width matters more than the function: with the
former 64-bit hash a colliding block is about 2^32 hash computations away, so a client could
craft a prompt whose block aliases another prompt's and be served (or make others be served)
KV that belongs to different tokens; at 256 bits a collision is out of reach. SHA-256 over
BLAKE2b-256: both are collision resistant at this width, SHA-256 is the FIPS-approved one that
deployments under such a policy may require, and the cost difference is small (about 1.5 us
against 1 us per 16-token block measured here, once per block of a request, off the step path).
"""

import hashlib
import struct
from collections.abc import Sequence

BLOCK_HASH_BYTES = 32                 # SHA-256 digest size; services.wire validates it
NONE_HASH = bytes(BLOCK_HASH_BYTES)   # parent hash of the first block


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """One block's chained hash. Token ids and the extra key are length-prefixed so that no
    two different (tokens, key) pairs feed the same bytes to the hash."""
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra_key)))
    h.update(extra_key)
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent_hash: bytes = NONE_HASH,
                     start_block: int = 0, cache_salt: bytes = b"") -> list[bytes]:
    """Hashes of the full blocks from `start_block` on; `parent_hash` is block start_block-1's.

    `cache_salt` is hashed into block 0 only (the chain carries it to the rest), so it matters
    only when `start_block` is 0; an empty salt is no salt."""
    hashes: list[bytes] = []
    for begin in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        extra_key = cache_salt if begin == 0 else b""
        parent_hash = hash_block(parent_hash, token_ids[begin:begin + block_size], extra_key)
        hashes.append(parent_hash)
    return hashes
