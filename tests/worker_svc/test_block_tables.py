"""The worker's persistent block tables (worker_svc.block_tables) and the kernel path's metadata
built from them with numpy (worker_svc.attention.build_kernel_metadata): the same tensors as
the list-based builder, its slow twin, on randomized steps; rows reused; capacity grown."""

import random

import numpy as np
import pytest
import torch

from worker_svc.attention import build_group_metadata, build_kernel_metadata
from worker_svc.block_tables import INITIAL_BLOCKS, INITIAL_ROWS, BlockTables

BLOCK_SIZE = 4


def random_step(rng: random.Random, num_groups: int
                ) -> tuple[list[int], list[int], list[list[list[int]]]]:
    """Query and context lengths (one-token queries first) and every request's table per
    group (of one length in every group), long enough and sometimes longer."""
    num_reqs = rng.randint(1, 40)
    num_decodes = rng.randint(0, num_reqs)
    query = [1] * num_decodes + [rng.randint(2, 20) for _ in range(num_reqs - num_decodes)]
    context = [rng.randint(0, 90) for _ in range(num_reqs)]
    lengths = [-(-(c + q) // BLOCK_SIZE) + rng.randint(0, 3)
               for q, c in zip(query, context, strict=True)]
    tables = [[[rng.randint(1, 999) for _ in range(n)] for n in lengths]
              for _ in range(num_groups)]
    return query, context, tables


@pytest.mark.parametrize("num_groups", [1, 2])
def test_kernel_metadata_equals_the_list_builder(num_groups: int) -> None:
    rng = random.Random(num_groups)
    for _ in range(50):
        query, context, group_tables = random_step(rng, num_groups)
        batch = BlockTables(num_groups)
        rows = [batch.add([group_tables[g][i] for g in range(num_groups)])
                for i in range(len(query))]
        q, c = np.array(query, dtype=np.int64), np.array(context, dtype=np.int64)
        need = (q + c + BLOCK_SIZE - 1) // BLOCK_SIZE
        fast = build_kernel_metadata(q, c, batch.gather(np.array(rows), need), BLOCK_SIZE,
                                     torch.device("cpu"))
        slow = build_group_metadata(query, context, group_tables, BLOCK_SIZE, 1000,
                                    torch.device("cpu"), torch_path=False)
        assert len(fast) == len(slow) == num_groups
        for f, s in zip(fast, slow, strict=True):
            assert f.num_decodes == s.num_decodes
            for name in ("positions", "slot_mapping", "block_table", "row_request",
                         "row_kv_lens"):
                assert torch.equal(getattr(f, name), getattr(s, name)), name


def test_rows_are_reused_grown_and_appended_to() -> None:
    tables = BlockTables(2)
    long_ids = list(range(1, 2 * INITIAL_BLOCKS + 5))
    rows = [tables.add([[i + 1], [i + 2]]) for i in range(INITIAL_ROWS + 3)]
    assert rows == list(range(INITIAL_ROWS + 3))          # capacity doubled
    tables.free(5)
    assert tables.add([long_ids, long_ids]) == 5             # reused, widened
    tables.append(5, [[7, 8], [9, 10]])
    [full, sliding] = tables.gather(np.array([5, 6]), np.array([len(long_ids) + 2, 1]))
    assert full[0].tolist() == long_ids + [7, 8]
    assert sliding[0, -2:].tolist() == [9, 10]
    assert full[1].tolist() == [7] + [0] * (len(long_ids) + 1)   # 0-padded past its blocks
    with pytest.raises(ValueError, match="cannot hold"):
        tables.gather(np.array([6]), np.array([2]))
    tables.free(5)
    assert tables.add([[1], [1]]) == 5 and tables.num_table_blocks[5] == 1
    assert tables.tables[0, 5, 1:].sum() == 0                # a freed row comes back clean
