"""Block bookkeeping of one replica: applies the scheduler's batched per-step plan to a pool.

`ReplicaBlockManager.apply` implements the semantics documented on
`services.kv_wire.PlanRequest`: commits, then frees, then grows (each fails alone), then
admissions (first come, first served: the first that does not fit stops the rest). A plan is
validated in full before anything changes, so a refused plan (`PlanReply.error`) leaves the
replica exactly as it was. Called by
`kvcache_svc.pools` under its lock; needs no network.

It also answers the read-only prefix query (`num_cached_prefix_blocks`) and, when recording,
hands out the prefix-index changes of each operation as wire KV events (`drain_events`).

KV groups (services.kv_groups, shared/DESIGN.md section 4): every request holds one block table
per group (request_blocks), all drawn from the one pool. An admission fills every table; a
grow appends to every table, and a sliding group first gives back the blocks its window left
(`first_kept_block` of the step's start, `GrowOp.num_computed_tokens`), so the grow may reuse
them. Prefix hits are per group (prefix_hits). A model of one group behaves as before groups.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvcache_svc.block_pool import BlockPool, IndexLog
from kvcache_svc.kv_store.view import StoreView
from kvcache_svc.prefix_hits import hit_tables, longest_hit
from kvcache_svc.request_blocks import RequestBlocks
from services.kv_groups import FULL_ATTENTION, first_kept_block
from services.kv_wire import (
    AdmitOp,
    AdmitResult,
    BlockRemoved,
    BlockStored,
    CommitOp,
    GrowOp,
    KvEvent,
    PlanReply,
    PlanRequest,
)
from services.wire import (
    MAX_BLOCKS_PER_REQUEST,
    MAX_KV_GROUPS,
)


class PlanError(ValueError):
    """A plan that breaks the contract (unknown or repeated ids, inconsistent sizes)."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    block_size: int             # tokens per block
    num_blocks: int             # usable blocks (null block excluded)
    num_used_blocks: int        # referenced by at least one request
    num_free_blocks: int        # not referenced, cached ones included
    num_cached_blocks: int      # in the prefix index, referenced or not
    num_queries: int            # tokens of admitted requests looked up in the index
    num_hits: int               # of those, tokens served from cache
    num_store_hits: int         # of those, tokens loaded from the KV store instead
    num_requests: int           # requests holding blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class ReplicaBlockManager:
    """One replica's pool plus the blocks of each request on it."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, *,
                 epoch: int = 0, record_events: bool = False,
                 store: StoreView | None = None, group_windows: Sequence[int] = (0,),
                 save_chunk_tokens: int = 0) -> None:
        """`store`: the KV store as this replica sees it (None: admissions never load).
        `group_windows`: the model's KV groups (`KvGroupLayout.windows`). `save_chunk_tokens`:
        the chunk size of the KV store the workers save to (0: none), whose chunk in progress
        a sliding group keeps (`first_kept_block`)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 1 <= len(group_windows) <= MAX_KV_GROUPS or min(group_windows) < 0:
            raise ValueError(f"group windows must be 1 to {MAX_KV_GROUPS} windows >= 0, got "
                             f"{list(group_windows)}")
        if save_chunk_tokens % block_size:
            raise ValueError(f"store chunks of {save_chunk_tokens} tokens are no multiple of "
                             f"the block size {block_size}")
        self.windows = tuple(group_windows)
        self.num_groups = len(self.windows)
        self.has_sliding = any(w != FULL_ATTENTION for w in self.windows)
        self.save_chunk_tokens = save_chunk_tokens
        self.pool = BlockPool(num_blocks, IndexLog() if record_events else None,
                              self.num_groups)
        self.epoch = epoch                  # of the kvcache_svc instance, put in every reply
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.requests: dict[str, RequestBlocks] = {}
        self.store = store
        self.num_queries = 0
        self.num_hits = 0
        self.num_store_hits = 0

    # ------------------------------------------------------------------------------ the plan

    def apply(self, plan: PlanRequest) -> PlanReply:
        try:
            self._validate(plan)
        except PlanError as exc:
            return PlanReply(plan.plan_id, [], [], self.pool.num_free_blocks, str(exc),
                             self.epoch)
        for commit in plan.commits:
            self._commit_only(commit)
        for request_id in plan.free_ids:
            self._free(request_id)
        grown = [self._grow(op) for op in plan.grows]
        admitted: list[AdmitResult] = []
        for op in plan.admits:
            result = self._admit(op)
            if result is None:
                break
            admitted.append(result)
        return PlanReply(plan.plan_id, grown, admitted, self.pool.num_free_blocks, None,
                         self.epoch)

    def _validate(self, plan: PlanRequest) -> None:
        """Raises PlanError unless every op of `plan` can be applied in order. Whether a grow or
        an admission fits is not checked here: not fitting is an answer, not an error."""
        for commit in plan.commits:
            self._validate_commit(commit)
        _unique([op.request_id for op in plan.commits], "commit")
        freed = _unique(plan.free_ids, "free")
        for request_id in freed:
            if request_id not in self.requests:
                raise PlanError(f"free of unknown request {request_id!r}")
        grown = _unique([op.request_id for op in plan.grows], "grow")
        for op in plan.grows:
            self._validate_grow(op, freed)
        _unique([op.request_id for op in plan.admits], "admit")
        for op in plan.admits:
            self._validate_admit(op, freed, grown)

    def _validate_grow(self, op: GrowOp, freed: set[str]) -> None:
        state = self.requests.get(op.request_id)
        if state is None or op.request_id in freed:
            raise PlanError(f"grow of unknown or freed request {op.request_id!r}")
        if cdiv(op.num_tokens, self.block_size) > MAX_BLOCKS_PER_REQUEST:
            raise PlanError(f"grow of {op.request_id!r} to {op.num_tokens} tokens exceeds "
                            f"{MAX_BLOCKS_PER_REQUEST} blocks")
        if op.num_computed_tokens > op.num_tokens:
            raise PlanError(f"grow of {op.request_id!r} to {op.num_tokens} tokens from "
                            f"{op.num_computed_tokens} computed ones")
        num_full = state.num_committed_blocks + len(op.new_block_hashes)
        if self.enable_prefix_caching and num_full * self.block_size > op.num_tokens:
            raise PlanError(f"grow of {op.request_id!r} commits {num_full} blocks, but "
                            f"{op.num_tokens} tokens fill only "
                            f"{op.num_tokens // self.block_size}")

    def _validate_commit(self, op: CommitOp) -> None:
        state = self.requests.get(op.request_id)
        if state is None:
            raise PlanError(f"commit of unknown request {op.request_id!r}")
        if state.num_committed_blocks + len(op.new_block_hashes) > state.num_table_blocks:
            raise PlanError(f"commit of {op.request_id!r}: {len(op.new_block_hashes)} more "
                            f"hashes than its {state.num_table_blocks} blocks hold")

    def _commit_only(self, op: CommitOp) -> None:
        state = self.requests[op.request_id]
        if self.enable_prefix_caching and op.new_block_hashes:
            self._commit(state, op.new_block_hashes, state.num_table_blocks)
            state.num_committed_blocks += len(op.new_block_hashes)

    def _validate_admit(self, op: AdmitOp, freed: set[str], grown: set[str]) -> None:
        # Freed then admitted in one plan is well defined (field order); held is not.
        if op.request_id in grown or (op.request_id in self.requests
                                      and op.request_id not in freed):
            raise PlanError(f"admit of {op.request_id!r}, which already holds blocks")
        if op.num_tokens < 1:
            raise PlanError(f"admit of {op.request_id!r} with no tokens")
        if cdiv(op.num_tokens, self.block_size) > MAX_BLOCKS_PER_REQUEST:
            raise PlanError(f"admit of {op.request_id!r} with {op.num_tokens} tokens exceeds "
                            f"{MAX_BLOCKS_PER_REQUEST} blocks")
        if len(op.block_hashes) * self.block_size > op.num_tokens:
            raise PlanError(f"admit of {op.request_id!r}: {len(op.block_hashes)} block hashes "
                            f"for {op.num_tokens} tokens")

    def _free(self, request_id: str) -> None:
        state = self.requests.pop(request_id)
        self.pool.free_blocks(state.held())

    def _first_kept(self, num_computed_tokens: int) -> list[int]:
        """Per group, the first table entry a request still needs (`first_kept_block`)."""
        return [first_kept_block(window, num_computed_tokens, self.block_size,
                                 self.save_chunk_tokens) for window in self.windows]

    def _grow(self, op: GrowOp) -> list[list[int]] | None:
        """The block ids appended to each group, or None (and no change) when they do not
        fit. Sliding groups give back what the step's window left before allocating."""
        state = self.requests[op.request_id]
        num_new_blocks = max(0, cdiv(op.num_tokens, self.block_size) - len(state.tables[0]))
        committing = self.enable_prefix_caching and op.new_block_hashes
        if not self.has_sliding and not num_new_blocks and not committing:
            return [[]] if self.num_groups == 1 else [[] for _ in state.tables]  # most decodes
        first_kept = self._first_kept(op.num_computed_tokens) if self.has_sliding else None
        num_returning = 0 if first_kept is None else state.num_returning(first_kept)
        if num_new_blocks * self.num_groups > self.pool.num_free_blocks + num_returning:
            return None
        if committing:      # entries the window leaves go back cached (evictable)
            self._commit(state, op.new_block_hashes, state.num_table_blocks)
        if first_kept is not None:
            state.release(first_kept, self.pool)
        new_blocks = [self.pool.get_new_blocks(num_new_blocks) for _ in state.tables]
        for table, blocks in zip(state.tables, new_blocks, strict=True):
            table.extend(blocks)
        if committing:
            self._commit(state, op.new_block_hashes, state.num_table_blocks,
                         state.num_table_blocks - num_new_blocks)
            state.num_committed_blocks += len(op.new_block_hashes)
        return [[block.block_id for block in blocks] for blocks in new_blocks]

    def _commit(self, state: RequestBlocks, block_hashes: list[bytes], end: int,
                start: int = 0) -> None:
        """Enters the hashes of entries num_committed_blocks ... (those in [start, end)) into
        each group's index; an entry already given back (null) is skipped."""
        first = state.num_committed_blocks
        lo, hi = max(first, start), min(first + len(block_hashes), end)
        null = self.pool.null_block
        for group, table in enumerate(state.tables):
            for i in range(lo, hi):
                if table[i] is not null:
                    self.pool.cache_block(table[i], block_hashes[i - first], group)

    def _admit(self, op: AdmitOp) -> AdmitResult | None:
        """Admits one request, or returns None (and changes nothing) when it does not fit."""
        num_hit_blocks = self._num_hit_blocks(op)
        num_cached = num_hit_blocks * self.block_size
        num_load = self._num_store_tokens(op, num_hit_blocks)
        num_new = op.num_tokens - num_cached - num_load
        if num_load and not op.compute_after_load:
            num_new = 0                 # the load's step computes nothing
        if num_new > op.max_num_new_tokens:
            if num_load and not op.allow_partial:
                num_new = 0             # load alone; the rest is computed after
            elif not op.allow_partial:
                return None
            else:
                num_new = op.max_num_new_tokens
        num_covered = num_cached + num_load + num_new
        tables = hit_tables(self.pool, self.windows, op.block_hashes, self.block_size,
                            num_hit_blocks)
        hits = [block for table in tables for block in table if block is not self.pool.null_block]
        num_new_blocks = cdiv(num_covered, self.block_size) - num_hit_blocks
        # Touching an evictable hit takes it out of the free queue, so it cannot also be new.
        num_evictable_hits = sum(1 for block in hits if block.ref_cnt == 0)
        num_free = (self.pool.num_free_blocks - num_evictable_hits) // self.num_groups
        if num_new_blocks > num_free and num_load and num_new:
            num_new = 0                 # the load alone may fit: the rest is computed after
            num_covered = num_cached + num_load
            num_new_blocks = cdiv(num_covered, self.block_size) - num_hit_blocks
        if num_new_blocks > num_free and num_load and op.allow_partial:
            # Memory pressure: load the whole chunks that fit; chunked prefill computes the
            # rest once the load is in (issue 24).
            num_load = self._num_load_within(num_hit_blocks + num_free, num_cached)
            num_new = 0
            num_covered = num_cached + num_load
            num_new_blocks = cdiv(num_covered, self.block_size) - num_hit_blocks
        if num_load == 0 and num_new == 0 or num_new_blocks > num_free:
            return None

        self.pool.touch(hits)
        num_freed = [sum(1 for block in table if block is self.pool.null_block)
                     for table in tables]
        for table in tables:
            table.extend(self.pool.get_new_blocks(num_new_blocks))
        state = RequestBlocks(tables, num_freed, 0)
        if self.enable_prefix_caching:
            # Blocks being loaded hold no KV yet, nor those computed after them before every
            # rank reported its load: the grow after the load commits them.
            num_committed = num_hit_blocks if num_load else min(
                len(op.block_hashes), num_covered // self.block_size)
            state.num_committed_blocks = num_hit_blocks
            self._commit(state, op.block_hashes[num_hit_blocks:num_committed], num_committed)
            state.num_committed_blocks = num_committed
            self.num_queries += op.num_tokens
            self.num_hits += num_cached
        self.num_store_hits += num_load
        if self.store is not None:
            self.store.count_last_lookup()
        self.requests[op.request_id] = state
        return AdmitResult(op.request_id, num_cached, num_new, state.block_ids(),
                           state.num_committed_blocks, num_load)

    def _num_store_tokens(self, op: AdmitOp, num_hit_blocks: int) -> int:
        """Tokens after the cached prefix to load from the KV store (0: compute them), leaving
        at least one token to compute, as a prefix hit does."""
        if self.store is None or not op.block_hashes and op.tail_hash is None:
            return 0
        self.store.last_lookup = (0, 0)
        num_held = self.store.num_held_tokens(op.block_hashes, op.num_tokens, op.tail_hash,
                                              num_hit_blocks)
        num_stored = min(num_held, op.num_tokens - 1)
        return max(0, num_stored - num_hit_blocks * self.block_size)

    def _num_load_within(self, num_blocks: int, num_cached: int) -> int:
        """Tokens to load past `num_cached` ending on a chunk boundary within `num_blocks`
        blocks (0: not one more chunk fits)."""
        assert self.store is not None
        chunk_tokens = self.store.store.chunk_tokens
        end = num_blocks * self.block_size // chunk_tokens * chunk_tokens
        return max(0, end - num_cached)

    def _num_hit_blocks(self, op: AdmitOp) -> int:
        """Blocks of the longest prefix of `op` every group serves from cache, leaving at
        least one token to compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return 0
        return longest_hit(self.pool, self.windows, op.block_hashes, self.block_size,
                           (op.num_tokens - 1) // self.block_size)

    # ------------------------------------------------------------------------------ queries

    def num_cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """Leading `block_hashes` every group's index serves (as an admission would, uncapped);
        changes nothing (0 with caching off, as the index is then always empty)."""
        return longest_hit(self.pool, self.windows, block_hashes, self.block_size,
                           len(block_hashes))

    def num_stored_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """Leading `block_hashes` whose KV the store holds for this replica (whole chunks);
        changes nothing, counts nothing."""
        if self.store is None:
            return 0
        return self.store.num_held_blocks(block_hashes)

    def drain_events(self) -> list[KvEvent]:
        """The prefix-index changes since the last call, in order, as wire events; always empty
        unless recording. A run longer than the wire's list limit is split."""
        if self.pool.index_log is None:
            return []
        events: list[KvEvent] = []
        limit = MAX_BLOCKS_PER_REQUEST
        for stored, group, block_hashes in self.pool.index_log.drain():
            chunks = ([block_hashes] if len(block_hashes) <= limit else
                      [block_hashes[i:i + limit] for i in range(0, len(block_hashes), limit)])
            events.extend(BlockStored(chunk, group) if stored else BlockRemoved(chunk, group)
                          for chunk in chunks)
        return events

    # ------------------------------------------------------------------------------ admin

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def stats(self) -> PoolStats:
        return PoolStats(
            block_size=self.block_size,
            num_blocks=self.pool.num_blocks,
            num_used_blocks=self.pool.num_used_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            num_queries=self.num_queries,
            num_hits=self.num_hits,
            num_store_hits=self.num_store_hits,
            num_requests=len(self.requests),
        )

    def clear(self) -> int:
        """Drops every unreferenced block from the prefix index; returns how many."""
        return self.pool.clear_cache()


def _unique(request_ids: list[str], what: str) -> set[str]:
    seen = set(request_ids)
    if len(seen) != len(request_ids):
        raise PlanError(f"a request id appears twice among the {what} ops")
    return seen
