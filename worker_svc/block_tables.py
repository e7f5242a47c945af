"""The worker's persistent block tables: every held request's blocks, one row of a numpy array
per request and one array per KV group, updated with each step's diff (new rows for new
requests, appended entries for grown ones, rows freed with finished ids).

`InputBatch` (worker_svc.input_batch) keeps them beside each request's state, and a step's
attention metadata is gathered from them in one indexing per group
(worker_svc.attention.build_kernel_metadata) instead of being rebuilt from Python lists: a
decode step's host time is a few array operations, whatever the number of rows.

Entries past a row's length are 0 (the null block), so a gathered table is 0-padded as the
kernels want it. Capacity grows by doubling, rows and columns alike; a freed row is reused.
"""

from collections.abc import Sequence

import numpy as np

INITIAL_ROWS = 64
INITIAL_BLOCKS = 64


class BlockTables:
    __slots__ = ("num_groups", "tables", "num_table_blocks", "_free_rows", "_next_row")

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        # [num_groups, rows, blocks] int64 block ids, 0-padded.
        self.tables = np.zeros((num_groups, INITIAL_ROWS, INITIAL_BLOCKS), dtype=np.int64)
        self.num_table_blocks = np.zeros(INITIAL_ROWS, dtype=np.int64)   # entries per row
        self._free_rows: list[int] = []
        self._next_row = 0

    def add(self, block_ids: Sequence[Sequence[int]]) -> int:
        """A new request's tables (per group, the same length); its row."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self._next_row
            self._next_row += 1
            if row >= self.tables.shape[1]:
                self._grow(rows=2 * self.tables.shape[1])
        num = len(block_ids[0])
        self._fit(num)
        for group, ids in enumerate(block_ids):
            self.tables[group, row, :num] = ids
        self.num_table_blocks[row] = num
        return row

    def append(self, row: int, new_block_ids: Sequence[Sequence[int]]) -> None:
        """Entries a grow appended, per group."""
        start = int(self.num_table_blocks[row])
        end = start + len(new_block_ids[0])
        if end == start:
            return
        self._fit(end)
        for group, ids in enumerate(new_block_ids):
            self.tables[group, row, start:end] = ids
        self.num_table_blocks[row] = end

    def free(self, row: int) -> None:
        num = int(self.num_table_blocks[row])
        self.tables[:, row, :num] = 0
        self.num_table_blocks[row] = 0
        self._free_rows.append(row)

    def gather(self, rows: np.ndarray, num_blocks: np.ndarray) -> list[np.ndarray]:
        """Per group, the tables of `rows` cut to `num_blocks` entries each (the rest 0):
        [len(rows), max(num_blocks)] int64. ValueError when a row holds fewer."""
        short = self.num_table_blocks[rows] < num_blocks
        if short.any():
            i = int(np.flatnonzero(short)[0])
            raise ValueError(f"block table of {self.num_table_blocks[rows[i]]} blocks cannot "
                             f"hold {num_blocks[i]} blocks")
        width = int(num_blocks.max()) if len(num_blocks) else 1
        past = np.arange(width)[None, :] >= num_blocks[:, None]       # [rows, width]
        out = []
        for group in range(self.num_groups):
            table = self.tables[group, rows, :width]                    # a copy (fancy index)
            table[past] = 0
            out.append(table)
        return out

    def _fit(self, num_blocks: int) -> None:
        if num_blocks > self.tables.shape[2]:
            width = self.tables.shape[2]
            while width < num_blocks:
                width *= 2
            self._grow(blocks=width)

    def _grow(self, rows: int | None = None, blocks: int | None = None) -> None:
        g, r, b = self.tables.shape
        rows, blocks = rows or r, blocks or b
        tables = np.zeros((g, rows, blocks), dtype=np.int64)
        tables[:, :r, :b] = self.tables
        self.tables = tables
        if rows > r:
            lens = np.zeros(rows, dtype=np.int64)
            lens[:r] = self.num_table_blocks
            self.num_table_blocks = lens
