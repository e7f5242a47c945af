"""Prefix hits over KV groups: the longest cached prefix that every group of a replica can serve.

Called by `block_manager.ReplicaBlockManager` at admission and for the read-only prefix query.
A hit of k blocks (k * block_size tokens) means the request's next query starts at token
k * block_size. A full-attention group needs its blocks 0 .. k-1 cached; a sliding group of
window W needs only the blocks that query and later ones read, `first_needed_block(W, k *
block_size)` .. k-1 (the entries before stay the null block). Each group looks in its own
index (block_pool). The hit is the largest k every group serves: for full groups the shortest
of their cached prefixes; a sliding group's blocks are not a prefix (the early ones may be
evicted), so k is walked down from there until each sliding group holds a run of cached
blocks long enough to end at block k-1.
"""

from collections.abc import Sequence

from kvcache_svc.block_pool import BlockPool, KVBlock
from services.kv_groups import FULL_ATTENTION, first_needed_block


def longest_hit(pool: BlockPool, windows: Sequence[int], block_hashes: Sequence[bytes],
                block_size: int, max_blocks: int) -> int:
    """Blocks of the longest prefix of `block_hashes` (at most `max_blocks`) that every
    group (`windows`, in group order) can serve from its index; changes nothing."""
    num_blocks = min(max_blocks, len(block_hashes))
    for group, window in enumerate(windows):
        if num_blocks and window == FULL_ATTENTION:
            num_blocks = pool.num_cached_prefix_blocks(block_hashes[:num_blocks], group)
    sliding = [(group, window) for group, window in enumerate(windows)
               if window != FULL_ATTENTION]
    if not sliding or not num_blocks:
        return num_blocks
    # runs[i]: cached blocks in a row ending at block i, per sliding group.
    needs = []
    for group, window in sliding:
        runs, run = [], 0
        for block_hash in block_hashes[:num_blocks]:
            run = run + 1 if pool.is_cached(block_hash, group) else 0
            runs.append(run)
        needs.append((window, runs))
    while num_blocks:
        if all(runs[num_blocks - 1] >= num_blocks - first_needed_block(
                window, num_blocks * block_size, block_size) for window, runs in needs):
            return num_blocks
        num_blocks -= 1
    return 0


def hit_tables(pool: BlockPool, windows: Sequence[int], block_hashes: Sequence[bytes],
               block_size: int, num_blocks: int) -> list[list[KVBlock]]:
    """Per group, the table entries of a hit of `num_blocks` blocks (`longest_hit`): cached
    blocks, and the null block where a sliding group's window no longer reads."""
    tables = []
    for group, window in enumerate(windows):
        first = min(num_blocks, first_needed_block(window, num_blocks * block_size, block_size))
        table = [pool.null_block] * first
        for block_hash in block_hashes[first:num_blocks]:
            block = pool.get_cached_block(block_hash, group)
            assert block is not None, "hit_tables past longest_hit"
            table.append(block)
        tables.append(table)
    return tables
