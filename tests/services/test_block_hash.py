"""Chained block hashes: 256-bit, chained, and salted per tenant through the first block."""

import hashlib

from services.block_hash import BLOCK_HASH_BYTES, NONE_HASH, hash_block, hash_full_blocks

BLOCK_SIZE = 4
PROMPT = list(range(100, 114))          # 3 full blocks and 2 tokens


def test_hashes_are_256_bit_sha256_digests() -> None:
    hashes = hash_full_blocks(PROMPT, BLOCK_SIZE)
    assert BLOCK_HASH_BYTES == 32 and len(NONE_HASH) == 32
    assert len(hashes) == 3 and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert len(set(hashes)) == 3
    assert hash_block(NONE_HASH, PROMPT[:4]) == hashlib.sha256(
        NONE_HASH + (4).to_bytes(4, "little")
        + b"".join(t.to_bytes(4, "little") for t in PROMPT[:4])
        + (0).to_bytes(4, "little")).digest()


def test_chain_covers_the_whole_prefix() -> None:
    """Equal hashes mean equal prefixes: a change in block 0 changes every later hash."""
    base = hash_full_blocks(PROMPT, BLOCK_SIZE)
    changed = hash_full_blocks([7] + PROMPT[1:], BLOCK_SIZE)
    assert all(a != b for a, b in zip(base, changed))
    same_start = hash_full_blocks(PROMPT[:8] + [1, 2, 3, 4], BLOCK_SIZE)
    assert same_start[:2] == base[:2] and same_start[2] != base[2]


def test_salt_changes_every_block_and_equal_salts_agree() -> None:
    unsalted = hash_full_blocks(PROMPT, BLOCK_SIZE)
    salt_a = hash_full_blocks(PROMPT, BLOCK_SIZE, cache_salt=b"tenant-a")
    salt_b = hash_full_blocks(PROMPT, BLOCK_SIZE, cache_salt=b"tenant-b")
    assert hash_full_blocks(PROMPT, BLOCK_SIZE, cache_salt=b"tenant-a") == salt_a
    assert hash_full_blocks(PROMPT, BLOCK_SIZE, cache_salt=b"") == unsalted
    for x, y in ((unsalted, salt_a), (unsalted, salt_b), (salt_a, salt_b)):
        assert all(a != b for a, b in zip(x, y))


def test_salt_enters_the_first_block_only() -> None:
    """Extending a request's hashes block by block (as it grows) gives the hashes of the whole
    token list: the salt is not hashed again into later blocks."""
    whole = hash_full_blocks(PROMPT, BLOCK_SIZE, cache_salt=b"s")
    first = hash_full_blocks(PROMPT[:4], BLOCK_SIZE, cache_salt=b"s")
    rest = hash_full_blocks(PROMPT, BLOCK_SIZE, first[-1], start_block=1, cache_salt=b"s")
    assert first + rest == whole
    assert whole[1] == hash_block(whole[0], PROMPT[4:8])


def test_salt_and_tokens_cannot_stand_in_for_each_other() -> None:
    """Length prefixes keep (tokens, salt) pairs apart even when their bytes line up."""
    two = (2).to_bytes(4, "little")
    assert hash_block(NONE_HASH, [1, 2], b"") != hash_block(NONE_HASH, [1], two)
