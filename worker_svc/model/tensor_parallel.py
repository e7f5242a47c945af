"""Tensor parallelism: which slice of every weight a TP rank holds, and the collectives.

`TpShard` is pure arithmetic (unit-tested without processes). For tp_size ranks of one stage:

- Attention heads. Each rank holds whole KV heads and all the query heads that read them, so
  attention on a rank is plain GQA with a uniform group (no cross-rank attention):
  * tp_size <= num_kv_heads: the KV heads are split as evenly as possible (SmolLM2's 3 KV heads
    on 2 ranks: 2 and 1, i.e. 6 and 3 query heads);
  * tp_size > num_kv_heads: every rank holds one KV head, replicated on the ranks that share
    its query group, and those ranks split the group's query heads.
  q/k/v projections are column-parallel (rows of the [out, in] weights), o_proj row-parallel
  (columns), followed by an all-reduce.
- MLP: gate/up column-parallel over the intermediate size, down row-parallel + all-reduce. The
  split is in whole 32-wide groups where possible so GGUF 4-bit blocks slice cleanly.
- Vocabulary: the embedding and LM head are split by rows. A token's embedding comes from the
  rank that holds its row (others contribute zeros; an all-reduce sums them, exactly); each
  rank's logits slice is all-gathered, so every rank samples from the same full logits with the
  same per-request seeds and gets the same token.

`TpGroup` runs the collectives on a torch.distributed group (gloo on CPU, NCCL on GPU).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker_svc.kernels.quant_blocks import QUANT_BLOCK, QuantBlocks
from worker_svc.parallel import peer_lost


def split_sizes(total: int, parts: int, unit: int = 1) -> list[int]:
    """`total` split into `parts` contiguous sizes, multiples of `unit` when `total` is one,
    the first ones larger by one unit when it does not divide evenly."""
    if total % unit:
        unit = 1
    base, extra = divmod(total // unit, parts)
    return [(base + (1 if i < extra else 0)) * unit for i in range(parts)]


def _range(sizes: list[int], index: int) -> tuple[int, int]:
    start = sum(sizes[:index])
    return start, start + sizes[index]


@dataclass(frozen=True, slots=True)
class TpShard:
    """What TP rank `tp_rank` of `tp_size` holds. Ranges are [start, end)."""

    tp_rank: int
    tp_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_sizes: tuple[int, ...]        # every rank's vocab slice size, for the logits gather

    @classmethod
    def build(cls, tp_rank: int, tp_size: int, num_heads: int, num_kv_heads: int,
              intermediate_size: int, vocab_size: int) -> "TpShard":
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if tp_size > num_heads:
            raise ValueError(f"tensor-parallel size {tp_size} exceeds the model's "
                             f"{num_heads} attention heads")
        group = num_heads // num_kv_heads
        if tp_size <= num_kv_heads:
            kv = _range(split_sizes(num_kv_heads, tp_size), tp_rank)
            q = (kv[0] * group, kv[1] * group)
        else:
            # Ranks per KV head, then this rank's share of that head's query group.
            ranks_per_head = split_sizes(tp_size, num_kv_heads)
            head, first_rank = 0, 0
            while first_rank + ranks_per_head[head] <= tp_rank:
                first_rank += ranks_per_head[head]
                head += 1
            n = ranks_per_head[head]
            if n > group:
                raise ValueError(f"tensor-parallel size {tp_size} leaves a rank without a "
                                 f"query head ({num_kv_heads} KV heads of {group} queries)")
            lo, hi = _range(split_sizes(group, n), tp_rank - first_rank)
            kv = (head, head + 1)
            q = (head * group + lo, head * group + hi)
        vocab_sizes = split_sizes(vocab_size, tp_size)
        return cls(tp_rank, tp_size, q, kv,
                   _range(split_sizes(intermediate_size, tp_size, QUANT_BLOCK), tp_rank),
                   _range(vocab_sizes, tp_rank), tuple(vocab_sizes))

    @classmethod
    def whole(cls, num_heads: int, num_kv_heads: int, intermediate_size: int,
              vocab_size: int) -> "TpShard":
        return cls.build(0, 1, num_heads, num_kv_heads, intermediate_size, vocab_size)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


# ------------------------------------------------------------------------------ weight slices


def slice_rows(weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of an [out, in] matrix (or a vector), contiguous."""
    return weight[start:end].contiguous()


def slice_cols(weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return weight[:, start:end].contiguous()


def slice_quant_rows(blocks: QuantBlocks, start: int, end: int) -> QuantBlocks:
    return QuantBlocks(*(slice_rows(t, start, end)
                         for t in (blocks.values, blocks.scales, blocks.offsets)), blocks.bits)


def slice_quant_cols(blocks: QuantBlocks, start: int, end: int) -> QuantBlocks | None:
    """Input columns [start, end); None when the cut falls inside a 32-wide block."""
    if start % QUANT_BLOCK or end % QUANT_BLOCK:
        return None
    g0, g1 = start // QUANT_BLOCK, end // QUANT_BLOCK
    return QuantBlocks(slice_cols(blocks.values, start, end), slice_cols(blocks.scales, g0, g1),
                       slice_cols(blocks.offsets, g0, g1), blocks.bits)


# -------------------------------------------------------------------------------- collectives


class TpGroup:
    """The collectives of one stage's TP ranks over an existing torch.distributed group."""

    def __init__(self, group: "dist.ProcessGroup", shard: TpShard) -> None:
        self.group = group
        self.shard = shard

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns `t`."""
        try:
            dist.all_reduce(t, group=self.group)
        except RuntimeError as exc:   # gloo/NCCL errors, DistError among them
            raise peer_lost(exc, "TP all-reduce") from exc
        return t

    def agree_min(self, values: list[int], device: torch.device) -> list[int]:
        """The smallest of each value over the ranks (every rank passes as many, in the same
        order): what all of them hold, e.g. the tokens every rank's KV load got."""
        t = torch.tensor(values, dtype=torch.int64, device=device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as exc:
            raise peer_lost(exc, "TP all-reduce (min)") from exc
        return [int(v) for v in t.tolist()]

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, local vocab] on every rank -> [rows, vocab], rank order. Slices may differ
        by one row in size, so each is padded to the largest and trimmed after the gather."""
        widest = max(self.shard.vocab_sizes)
        rows = logits.shape[0]
        padded = logits.new_zeros(rows, widest)
        padded[:, :logits.shape[1]] = logits
        parts = [torch.empty_like(padded) for _ in self.shard.vocab_sizes]
        try:
            dist.all_gather(parts, padded, group=self.group)
        except RuntimeError as exc:
            raise peer_lost(exc, "TP all-gather") from exc
        return torch.cat([p[:, :n] for p, n in zip(parts, self.shard.vocab_sizes, strict=True)],
                         dim=1)
