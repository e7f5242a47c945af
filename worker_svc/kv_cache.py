"""KV-cache sizing and allocation for the layers this worker holds.

KV tensors are shaped `[2, num_blocks, block_size, num_kv_heads, head_dim]` (see
`worker_svc.attention`), one per tensor position of the model's KV group layout
(services.kv_groups) that this worker's layers use: a uniform model has one per layer; in a
hybrid model the i-th layer of every group shares position i's tensor (a block id belongs to
one group at a time). All tensors share one block count. The runner sizes the cache from a
byte budget (`KvGroupLayout.num_blocks`, or `num_blocks_for_budget` over one spec per
tensor), reports it, and allocates once the replica-wide count is agreed; `layer_caches` then
gives each layer its position's tensor.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KvLayerSpec:
    """What one attention layer stores per block."""

    block_size: int           # tokens per block
    num_kv_heads: int         # KV heads held by this worker (a TP slice holds fewer)
    head_dim: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of this layer: keys and values."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def shape_per_block(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)


def bytes_per_block(specs: list[KvLayerSpec]) -> int:
    """Bytes one block id costs across all of this worker's layers."""
    return sum(spec.page_bytes for spec in specs)


def num_blocks_for_budget(budget_bytes: int, specs: list[KvLayerSpec]) -> int:
    """How many blocks (the null block 0 included) fit in `budget_bytes` for these layers."""
    if not specs:
        raise ValueError("no KV layers to size")
    if len({spec.block_size for spec in specs}) != 1:
        raise ValueError("all layers must share one block size")
    return max(0, budget_bytes) // bytes_per_block(specs)


def allocate_kv_caches(specs: list[KvLayerSpec], num_blocks: int,
                       device: torch.device | None = None) -> list[torch.Tensor]:
    """One zeroed `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), "
                         f"got {num_blocks}")
    return [torch.zeros((2, num_blocks, *spec.shape_per_block), dtype=spec.dtype, device=device)
            for spec in specs]


def layer_caches(tensors: Sequence[torch.Tensor], positions: Sequence[int],
                 layer_positions: Sequence[int]) -> list[torch.Tensor]:
    """Each layer's KV tensor: `tensors[i]` holds tensor position `positions[i]`, and layer j
    uses position `layer_positions[j]`."""
    by_position = dict(zip(positions, tensors, strict=True))
    return [by_position[position] for position in layer_positions]
