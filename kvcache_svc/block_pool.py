"""The blocks of one replica's paged KV cache: ref counts, LRU free queue, prefix-hash index.

Owned by `block_manager.ReplicaBlockManager`, which holds one pool per replica. Block 0 is the
null block: it is never handed out and never freed. A free block may still carry a prefix hash
(it is then "evictable"): it stays findable in the index until it is handed out again, at which
point its hash is dropped. The free queue is in eviction order: the head goes first.

Every KV group (services.kv_groups) draws from the one free queue, but has its own prefix index:
a block holds one group's layers' KV, so a hash found in group g's index serves group g only.

A pool given an `IndexLog` records every change to its prefix index there, in order: the
hashes entered by `cache_block` and those dropped by eviction or `clear_cache`. kvcache_svc
publishes them as KV events; recording costs one list append per changed hash.
"""

from collections.abc import Iterable

NULL_BLOCK_ID = 0
MAX_NUM_BLOCKS = 1 << 22  # blocks per pool, null block included: bounds this process's memory


class KVBlock:
    """One page of `block_size` token slots, as bookkeeping (the tensors live on the workers)."""

    __slots__ = ("block_hash", "block_id", "cache_group", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0                          # requests holding this block
        self.block_hash: bytes | None = None      # set while the block is in the prefix index
        self.cache_group = 0                      # the KV group whose index holds that hash
        self.prev_free: KVBlock | None = None     # links of the free queue; None when not in it
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    Every operation is O(1), including removing a block from the middle (a prefix hit on an
    evictable block). Two sentinels keep the link updates free of edge cases.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVBlock, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class IndexLog:
    """Changes to one pool's prefix index since the last `drain`, in order.

    Kept as runs: (stored, group, hashes) with `stored` False for removals, consecutive changes
    of one kind in one KV group merged into one run. Order across runs matters: within one plan
    a hash can be evicted and then stored again (on another block).
    """

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs: list[tuple[bool, int, list[bytes]]] = []

    def add(self, stored: bool, group: int, block_hash: bytes) -> None:
        if self.runs and self.runs[-1][0] is stored and self.runs[-1][1] == group:
            self.runs[-1][2].append(block_hash)
        else:
            self.runs.append((stored, group, [block_hash]))

    def drain(self) -> list[tuple[bool, int, list[bytes]]]:
        runs, self.runs = self.runs, []
        return runs


class BlockPool:
    """Every block of one replica, the free queue and one prefix-hash index per KV group."""

    __slots__ = ("_cached", "blocks", "free_queue", "index_log", "null_block")

    def __init__(self, num_blocks: int, index_log: IndexLog | None = None,
                 num_groups: int = 1) -> None:
        if not 2 <= num_blocks <= MAX_NUM_BLOCKS:
            raise ValueError(f"num_blocks must be in [2, {MAX_NUM_BLOCKS}], got {num_blocks}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be at least 1, got {num_groups}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK_ID + 1:])
        # Per KV group, prefix hash -> the one block holding it. A second block computed with
        # the same hash (two requests missed the same prefix at once) is left out of the index.
        self._cached: list[dict[bytes, KVBlock]] = [{} for _ in range(num_groups)]
        self.index_log = index_log              # None: changes are not recorded

    @property
    def num_blocks(self) -> int:
        """Usable blocks: the null block excluded."""
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: truly free plus evictable (cached) ones."""
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix index (every group's), referenced or not."""
        return sum(len(index) for index in self._cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Takes `num_blocks` blocks from the head of the free queue (ref_cnt 1 each), evicting
        their prefix hashes."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, "
                             f"{self.free_queue.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self._cached[block.cache_group][block.block_hash]
                if self.index_log is not None:
                    self.index_log.add(False, block.cache_group, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes one more reference on each block (prefix hits); an evictable block leaves the
        free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drops one reference on each block. Blocks reaching 0 join the free queue in the
        given order, so callers pass a request's blocks last first: its tail is evicted before
        its head. Blocks without a hash hold nothing reusable and go to the head at once."""
        for block in ordered:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"freeing {block!r}, which no request holds")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: bytes, group: int = 0) -> bool:
        """Enters `block` into KV group `group`'s prefix index under `block_hash`. False when
        another block already holds that hash there (this one then stays out of the index) or
        `block` has one."""
        index = self._cached[group]
        if block_hash in index or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        block.cache_group = group
        index[block_hash] = block
        if self.index_log is not None:
            self.index_log.add(True, group, block_hash)
        return True

    def get_cached_block(self, block_hash: bytes, group: int = 0) -> KVBlock | None:
        return self._cached[group].get(block_hash)

    def is_cached(self, block_hash: bytes, group: int = 0) -> bool:
        return block_hash in self._cached[group]

    def num_cached_prefix_blocks(self, block_hashes: Iterable[bytes], group: int = 0) -> int:
        """How many leading `block_hashes` group `group`'s index holds, stopping at the first
        miss. Read-only: no block is touched or moved in the free queue."""
        index = self._cached[group]
        num_found = 0
        for block_hash in block_hashes:
            if block_hash not in index:
                break
            num_found += 1
        return num_found

    def clear_cache(self) -> int:
        """Drops the hashes of every unreferenced cached block; returns how many. Blocks in use
        keep theirs."""
        dropped = [(group, block_hash, block) for group, index in enumerate(self._cached)
                   for block_hash, block in index.items() if block.ref_cnt == 0]
        for group, block_hash, block in dropped:
            del self._cached[group][block_hash]
            if self.index_log is not None:
                self.index_log.add(False, group, block_hash)
            block.block_hash = None
            # Now worth nothing: reuse before the blocks that still hold a prefix.
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
        return len(dropped)
