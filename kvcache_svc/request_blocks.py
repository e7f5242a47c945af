"""The blocks one request holds in its replica's pool: one block table per KV group.

Owned by `block_manager.ReplicaBlockManager`. A table lists the request's blocks in token
order (entry i holds tokens [i * block_size, (i + 1) * block_size)); every group's table has
the same length. A sliding-window group (services.kv_groups) gives back the blocks its window
left: their entries become the null block, always a leading run of the table (`num_freed`),
since the window only moves forward.

Why giving a block back while a step may still read it is safe: a block is freed at the plan
of a step whose queries start past its window, and the step that last read it was planned
earlier (with async scheduling it may still run). The block can be handed out by this plan,
but is rewritten only by this step or a later one, which every pipeline stage runs after the
earlier step (each stage runs steps in order, and KV loads into fresh blocks wait for the work
queued before them: worker_svc.kv_loader).
"""

from collections.abc import Sequence

from kvcache_svc.block_pool import BlockPool, KVBlock


class RequestBlocks:
    """One request's block tables, one per KV group, and what it committed to the index."""

    __slots__ = ("num_committed_blocks", "num_freed", "tables")

    def __init__(self, tables: list[list[KVBlock]], num_freed: list[int],
                 num_committed_blocks: int) -> None:
        self.tables = tables                # per group, in token order; null where given back
        self.num_freed = num_freed          # per group: leading entries given back (null)
        # Leading blocks whose hashes were handed to the prefix index (the scheduler keeps the
        # same count and sends hashes for the blocks after them).
        self.num_committed_blocks = num_committed_blocks

    @property
    def num_table_blocks(self) -> int:
        """Entries of each table (tokens covered, in blocks)."""
        return len(self.tables[0])

    def block_ids(self) -> list[list[int]]:
        return [[block.block_id for block in table] for table in self.tables]

    def held(self) -> list[KVBlock]:
        """The blocks it holds (null entries left out), last position first, the groups'
        blocks of one position together: freed in this order, a request's tail is evicted
        before its head in every group."""
        if len(self.tables) == 1:
            table = self.tables[0]
            return table[:self.num_freed[0] - 1:-1] if self.num_freed[0] else table[::-1]
        return [table[i] for i in range(self.num_table_blocks - 1, -1, -1)
                for table, first in zip(self.tables, self.num_freed, strict=True)
                if i >= first]

    def num_returning(self, first_kept: Sequence[int]) -> int:
        """How many blocks `release(first_kept)` would put back in the free queue (a block
        another request also holds, a shared prefix, stays in use)."""
        return sum(1 for group, table in enumerate(self.tables)
                   for block in table[self.num_freed[group]:first_kept[group]]
                   if block.ref_cnt == 1)

    def release(self, first_kept: Sequence[int], pool: BlockPool) -> None:
        """Gives back every group's entries before `first_kept[group]` (the null block takes
        their place), each group's last first."""
        released: list[KVBlock] = []
        for group, table in enumerate(self.tables):
            first, end = self.num_freed[group], min(first_kept[group], len(table))
            if end <= first:
                continue
            released += table[first:end][::-1]
            table[first:end] = [pool.null_block] * (end - first)
            self.num_freed[group] = end
        if released:
            pool.free_blocks(released)
