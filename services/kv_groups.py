"""KV cache groups: which layers share block tables and KV tensors, and what a block costs.

A layer's attention is full (it reads every earlier token) or a sliding window of W tokens
(the query at position p reads keys p - W + 1 .. p). Layers of one kind form a **group**: a
request has one block table per group, and a sliding group needs only the blocks its window
still reads (kvcache_svc frees the rest; the table keeps the null block 0 there).

All groups draw block ids from one pool per replica, and each block id is a page in a set of
`group_size` tensors per worker: tensor i holds the pages of the i-th layer of every group.
A block id is given to one group at a time, so the layers sharing a tensor never share a page.
A model with one kind of layer is one group of all its layers (each layer its own tensor, as
before groups existed). A hybrid model's kinds are cut into groups of equal size (the last of
a kind may be shorter, leaving its tensor positions unused there): the size is the smallest
kind's layer count, or the largest kind's when that is within 1.25x of the smallest, so that
a nearly balanced model gets one group per kind and no padding positions. This is how vLLM
lays out hybrid models (one page size, `group_size` tensors shared across groups); the point
is memory: a sliding group's requests hold at most `max_blocks_in_window` blocks however long
they grow, and the pool they share is sized once for all groups.

Sizing, per worker: it holds the tensors of the group positions its layers use (a pipeline
stage may split a group), so one block id costs `page_bytes * len(positions)` there; the
replica takes the smallest block count over its ranks.

Pure functions of the per-layer windows: the scheduler, kvcache_svc and the workers derive the
same layout from the model config (`ModelConfig.layer_windows`).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FULL_ATTENTION = 0          # a layer window meaning "every earlier token"
BALANCED_RATIO = 1.25       # kinds within this ratio of layer counts get one group each


@dataclass(frozen=True, slots=True)
class KvGroup:
    """Layers of one attention kind that share a block table."""

    window: int                  # tokens a query reads back (itself included); 0 = all
    layer_ids: tuple[int, ...]   # model layer indices, ascending; at most `group_size`

    @property
    def is_sliding(self) -> bool:
        return self.window != FULL_ATTENTION


@dataclass(frozen=True, slots=True)
class KvGroupLayout:
    """The model's groups; layer `layer_ids[i]` of every group uses tensor position i."""

    groups: tuple[KvGroup, ...]
    group_size: int              # tensor positions: the longest group's layer count

    @classmethod
    def from_windows(cls, layer_windows: Sequence[int]) -> "KvGroupLayout":
        """Groups for a model whose layer l has window `layer_windows[l]` (0 = full)."""
        if not layer_windows:
            raise ValueError("a model needs at least one layer")
        if any(w < 0 for w in layer_windows):
            raise ValueError(f"layer windows must be >= 0, got {list(layer_windows)}")
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        counts = [len(layers) for layers in by_window.values()]
        size = min(counts)
        if max(counts) < BALANCED_RATIO * size:
            size = max(counts)
        groups = []
        for window in sorted(by_window):            # full attention first, then by window
            layers = by_window[window]
            for start in range(0, len(layers), size):
                groups.append(KvGroup(window, tuple(layers[start:start + size])))
        return cls(tuple(groups), max(len(g.layer_ids) for g in groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int, ...]:
        """Each group's window, in group order (what the step messages index by)."""
        return tuple(g.window for g in self.groups)

    def group_of(self, layer: int) -> int:
        for index, group in enumerate(self.groups):
            if layer in group.layer_ids:
                return index
        raise KeyError(f"layer {layer} is in no KV group")

    def position_of(self, layer: int) -> int:
        """The tensor position (0 .. group_size - 1) whose pages this layer uses."""
        return self.groups[self.group_of(layer)].layer_ids.index(layer)

    def positions(self, layer_ids: Iterable[int]) -> tuple[int, ...]:
        """The tensor positions a worker holding these layers allocates, ascending."""
        return tuple(sorted({self.position_of(layer) for layer in layer_ids}))

    def bytes_per_block(self, page_bytes: int, layer_ids: Iterable[int]) -> int:
        """What one block id costs a worker holding `layer_ids` (pages of `page_bytes`)."""
        return page_bytes * len(self.positions(layer_ids))

    def num_blocks(self, budget_bytes: int, page_bytes: int, layer_ids: Iterable[int]) -> int:
        """Blocks (the null block included) that fit `budget_bytes` on such a worker."""
        per_block = self.bytes_per_block(page_bytes, layer_ids)
        if per_block <= 0:
            raise ValueError("no KV layers to size")
        return max(0, budget_bytes) // per_block

    def describe(self) -> str:
        kinds = ", ".join(
            f"{'full' if not g.is_sliding else f'window {g.window}'}: layers "
            f"{_ranges(g.layer_ids)}" for g in self.groups)
        return f"{self.num_groups} KV group(s) of up to {self.group_size} layers ({kinds})"


def first_needed_token(window: int, num_computed_tokens: int) -> int:
    """The earliest token whose KV a request still reads once `num_computed_tokens` are in
    the cache: the next query (at position num_computed_tokens) reads back `window` tokens,
    itself included, and later queries read later ones. 0 for full attention."""
    if window == FULL_ATTENTION:
        return 0
    return max(0, num_computed_tokens - window + 1)


def first_needed_block(window: int, num_computed_tokens: int, block_size: int) -> int:
    """Blocks before this index hold no token the request reads again: a sliding group
    frees them (its table keeps the null block there)."""
    return first_needed_token(window, num_computed_tokens) // block_size


def first_kept_block(window: int, num_computed_tokens: int, block_size: int,
                     save_chunk_tokens: int = 0) -> int:
    """Where a sliding group's table starts holding blocks once `num_computed_tokens` are in
    the cache: before it, nothing is read again (`first_needed_block`), and, when a KV store
    saves chunks of `save_chunk_tokens` (a multiple of `block_size`; 0: no saving), every
    chunk is complete: the chunk in progress keeps its blocks until the step that completes
    it has copied it out. kvcache_svc frees the blocks before it; the scheduler counts on it.
    0 for full attention."""
    first = first_needed_block(window, num_computed_tokens, block_size)
    if save_chunk_tokens:
        first = min(first, num_computed_tokens // save_chunk_tokens * save_chunk_tokens
                    // block_size)
    return first


def max_blocks_in_window(window: int, block_size: int, num_new_tokens: int = 1,
                         save_chunk_tokens: int = 0) -> int:
    """The most blocks a sliding group's request holds while computing `num_new_tokens`
    tokens: the `window - 1` tokens behind the first new one and the new ones, a run of S
    tokens, lie in at most ceil((S - 1) / block_size) + 1 blocks. A decode with a window of
    256 and blocks of 16 holds at most 17."""
    if window == FULL_ATTENTION:
        raise ValueError("a full-attention group holds every block")
    # With chunk saving (`first_kept_block`) up to `save_chunk_tokens - 1` tokens of the
    # chunk in progress stay behind the first new one too.
    span = max(window, save_chunk_tokens) - 1 + num_new_tokens
    return -(-(span - 1) // block_size) + 1


def max_blocks_per_request(windows: Sequence[int], num_tokens: int, block_size: int,
                           max_num_new_tokens: int, save_chunk_tokens: int = 0) -> int:
    """The most blocks one request of `num_tokens` tokens holds over all groups of these
    `windows` in a step of up to `max_num_new_tokens` tokens: every block in a full group,
    at most the window's in a sliding one."""
    num_blocks = -(-num_tokens // block_size)
    return sum(num_blocks if w == FULL_ATTENTION else min(num_blocks, max_blocks_in_window(
        w, block_size, max(1, max_num_new_tokens), save_chunk_tokens)) for w in windows)


def max_tokens_per_request(windows: Sequence[int], num_blocks: int, block_size: int,
                           max_num_new_tokens: int, save_chunk_tokens: int = 0,
                           limit: int = 1 << 40) -> int:
    """The longest request (in tokens, at most `limit`) whose blocks fit `num_blocks` usable
    blocks (`max_blocks_per_request`); `limit` when sliding groups alone never outgrow them."""
    def fits(n: int) -> bool:
        return max_blocks_per_request(windows, n, block_size, max_num_new_tokens,
                                      save_chunk_tokens) <= num_blocks

    low, high = 0, limit                  # fits(low); the answer is in [low, high]
    if fits(high):
        return high
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _ranges(layer_ids: tuple[int, ...]) -> str:
    if len(layer_ids) > 2 and all(b - a == layer_ids[1] - layer_ids[0]
                                  for a, b in zip(layer_ids, layer_ids[1:], strict=False)):
        step = layer_ids[1] - layer_ids[0]
        return f"{layer_ids[0]}..{layer_ids[-1]}" + (f" step {step}" if step != 1 else "")
    return ",".join(map(str, layer_ids))
