"""The scheduler's side of KV groups (services.kv_groups): how many blocks a step takes, which
of them it enters into the prefix index, and how far ahead a plan grows a request.

`Scheduler` (scheduler.py) drafts each plan from an estimate of the replica's free blocks;
`KvBlocks` works out what a grow or an admission takes from it over every group (a sliding
group gives back the blocks its window left before it grows, exactly as kvcache_svc does, so a
long request's sliding groups count for a window of blocks), mirrors those frees in the
request's tables when the reply comes, and bounds the longest request the pool can hold.
"""

from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.request import Request
from services.kv_groups import first_kept_block, max_tokens_per_request

# Blocks a plan grows a request ahead of its step (pool permitting): a decode then needs no
# plan call for that many blocks' worth of steps (issue 37: at most one in four).
LOOKAHEAD_BLOCKS = 2
# Full blocks not yet in the prefix index that make a plan call due: a decode fills one now
# and then and waits for the next plan; a prompt computed or loaded is entered at once.
COMMITS_DUE = 2


class KvBlocks:
    def __init__(self, config: SchedulerConfig) -> None:
        self.windows = config.kv_group_windows        # per group; 0 = full attention
        self.num_groups = len(self.windows)
        self.block_size = config.block_size
        self.has_sliding = any(self.windows)
        self.prefix_caching = config.prefix_caching
        # Chunks of the KV store whose blocks sliding groups keep until complete (kvcache_svc
        # says so when the pool is configured, `KvAck.save_chunk_tokens`); 0: none.
        self.save_chunk_tokens = 0
        self.lookahead = LOOKAHEAD_BLOCKS * config.block_size   # tokens grown ahead

    def num_covered(self, request: Request) -> int:
        """Tokens its block tables cover."""
        return len(request.block_ids[0]) * self.block_size if request.block_ids else 0

    def commits_due(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request has COMMITS_DUE or more full blocks to enter into the prefix
        index once a step of `num_new_tokens` is planned."""
        if not self.prefix_caching:
            return False
        num_full = min((request.num_computed_tokens + num_new_tokens) // self.block_size,
                       len(request.block_hashes))
        return num_full - request.num_committed_blocks >= COMMITS_DUE

    def must_grow(self, request: Request, num_new_tokens: int) -> bool:
        """Whether a step of `num_new_tokens` needs table entries the request does not hold
        (kvcache_svc must append them, whatever the pool's count says)."""
        return request.num_computed_tokens + num_new_tokens > self.num_covered(request)

    def hashes_to_commit(self, request: Request, num_tokens_after: int) -> list[bytes]:
        """Hashes of the blocks a step that ends at `num_tokens_after` fills and kvcache_svc
        has not entered into the prefix index yet (none without prefix caching)."""
        if not self.prefix_caching:
            return []
        num_full = min(num_tokens_after // self.block_size, len(request.block_hashes))
        return request.block_hashes[request.num_committed_blocks:num_full]

    def first_kept(self, num_computed_tokens: int) -> list[int]:
        """Per group, the first table entry a request still holds once a step starts at
        `num_computed_tokens` (`kv_groups.first_kept_block`)."""
        return [first_kept_block(w, num_computed_tokens, self.block_size,
                                 self.save_chunk_tokens) for w in self.windows]

    def grow_cost(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks growing `request` by `num_new_tokens` takes: new entries in every group,
        less what its sliding groups give back first (negative: it gives back more)."""
        end = request.num_computed_tokens + num_new_tokens
        tables = request.block_ids
        num_new = max(0, -(-end // self.block_size) - (len(tables[0]) if tables else 0))
        cost = num_new * self.num_groups
        if self.has_sliding and request.block_ids:
            first_kept = self.first_kept(request.num_computed_tokens)
            for ids, num_freed, first in zip(request.block_ids, request.num_freed_blocks,
                                             first_kept, strict=True):
                cost -= max(0, min(first, len(ids)) - num_freed)
        return cost

    def admit_cost(self, num_new_tokens: int) -> int:
        """Blocks an admission computing `num_new_tokens` takes at most (no prefix hit)."""
        return -(-num_new_tokens // self.block_size) * self.num_groups

    def grown(self, request: Request, new_block_ids: list[list[int]]) -> None:
        """Applies a grow's reply (the step starts at `request.num_computed_tokens`)."""
        if len(new_block_ids) != self.num_groups:
            self.check(new_block_ids)
        if self.has_sliding:
            request.append_blocks(new_block_ids, self.first_kept(request.num_computed_tokens))
        elif self.num_groups == 1:
            request.block_ids[0] += new_block_ids[0]
        else:
            for ids, new_ids in zip(request.block_ids, new_block_ids, strict=True):
                ids += new_ids

    def check(self, block_ids: list[list[int]]) -> None:
        if len(block_ids) != self.num_groups:
            raise RuntimeError(f"kvcache_svc sent block ids for {len(block_ids)} KV groups; "
                               f"the model has {self.num_groups}")

    def max_request_tokens(self, num_blocks: int, max_step_tokens: int) -> int:
        """The longest request (prompt + outputs) whose blocks fit `num_blocks` usable blocks
        in a step of up to `max_step_tokens` (`kv_groups.max_tokens_per_request`)."""
        return max_tokens_per_request(self.windows, num_blocks, self.block_size,
                                      max_step_tokens, self.save_chunk_tokens)
