"""What the engine's plans ask of kvcache_svc beyond a step's admissions: grows (with blocks
ahead), commits of full blocks, and frees, held until a plan is due.

The scheduler (scheduler_svc.engine.scheduler) drafts a step's grows; `plan` turns them into
the plan's grow ops: every request that needs a block or has full blocks to commit, and, while
the pool has room to spare, every one that would run out within `KvBlocks.lookahead` tokens,
grown that far ahead, so steady decodes make no plan call for many steps. A request that ends
or is preempted is `release`d: its last full blocks are committed first (`CommitOp`, so its
prefix stays cached) and its blocks freed, both with the next plan, which is due at once only
when nothing else would send one soon (`frees_due`).
"""

from dataclasses import dataclass

from scheduler_svc.engine.kv_blocks import KvBlocks
from scheduler_svc.engine.request import Request
from services.kv_wire import AdmitOp, CommitOp, GrowOp, PlanRequest

# Growing ahead stops while the pool would keep less than 1/LOOKAHEAD_RESERVE of its blocks
# free; so do deferred frees (they are due then).
LOOKAHEAD_RESERVE = 8


@dataclass(slots=True)
class Grow:
    """A running request's share of a drafted step."""
    request: Request
    num_new: int                           # tokens it computes
    op: int | None = None                  # its grow op's index in the plan (None: no op)
    num_commits: int = 0                   # block hashes its op commits


class PlanBook:
    """One replica's plans: their ids, and the frees and commits waiting for the next."""

    def __init__(self, replica_id: int, kv_blocks: KvBlocks, prefix_caching: bool) -> None:
        self.replica_id = replica_id
        self.kv_blocks = kv_blocks
        self.prefix_caching = prefix_caching
        self.free_ids: list[str] = []      # requests whose blocks kvcache_svc must release
        self.commits: list[CommitOp] = []  # their last full blocks, committed before that
        self._plan_id = 0

    def pending(self) -> bool:
        return bool(self.free_ids or self.commits)

    def clear(self) -> None:
        """kvcache_svc lost the pool: nothing held for it is due any more."""
        self.free_ids.clear()
        self.commits.clear()

    def frees_due(self, busy: bool, num_free: int, num_total: int) -> bool:
        """Frees go with the next plan a step needs anyway, unless the replica is not `busy`
        (nothing running, or requests waiting for blocks) or the pool runs low."""
        return self.pending() and (not busy or num_free < num_total // LOOKAHEAD_RESERVE)

    def release(self, request: Request, commit: bool) -> None:
        """`request` gives its blocks back with the next plan; `commit`: its full blocks enter
        the prefix index first (not for an abort)."""
        if commit:
            self.final_commits(request)
        self.free_ids.append(request.request_id)

    def final_commits(self, request: Request) -> None:
        """The block hashes of a request about to be freed that became full since its last
        plan (kvcache_svc enters them first, so they stay cached): only blocks no step in
        flight is still writing."""
        if not self.prefix_caching or not request.block_ids:
            return
        end = request.num_computed_tokens - (1 if request.in_flight else 0)
        commits = self.kv_blocks.hashes_to_commit(request, end)
        if commits:
            self.commits.append(CommitOp(request.request_id, commits))
            request.num_committed_blocks += len(commits)

    def plan(self, grows: list[Grow], admits: list[AdmitOp], free: int,
             num_total: int) -> PlanRequest:
        """The next plan: the step's grows (`free`: blocks left after the step's own needs)
        and admissions, with every free and commit held so far."""
        self._plan_id += 1
        plan = PlanRequest(replica_id=self.replica_id, plan_id=self._plan_id,
                           free_ids=self.free_ids, grows=self._grow_ops(grows, free, num_total),
                           admits=admits, commits=self.commits)
        self.free_ids, self.commits = [], []
        return plan

    def _grow_ops(self, grows: list[Grow], free: int, num_total: int) -> list[GrowOp]:
        ops: list[GrowOp] = []
        spare = free - num_total // LOOKAHEAD_RESERVE
        kv = self.kv_blocks
        for grow in grows:
            request, num_new = grow.request, grow.num_new
            end = request.num_computed_tokens + num_new
            commits = kv.hashes_to_commit(request, end)
            target = end
            ahead = min(end + kv.lookahead, request.max_num_tokens)
            if ahead > kv.num_covered(request):
                extra = kv.grow_cost(request, ahead - request.num_computed_tokens) - \
                    kv.grow_cost(request, num_new)
                if extra <= spare:
                    spare -= extra
                    target = ahead
            if target == end and not commits and not kv.must_grow(request, num_new):
                continue
            grow.op, grow.num_commits = len(ops), len(commits)
            ops.append(GrowOp(request_id=request.request_id, num_tokens=target,
                              new_block_hashes=commits,
                              num_computed_tokens=request.num_computed_tokens))
        return ops
