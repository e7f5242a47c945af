"""Continuous batching for one replica: which requests run each step, and what comes back.

A step has three phases, and the scheduler owns the state between them (no network here):

1. `schedule()` drafts the step: grows of running requests (in arrival order, each capped by
   the token budget; when the free-block estimate runs out the latest running request is
   preempted by recompute), then admissions of waiting requests (clients in turn, or in order
   of arrival: scheduler_svc.engine.fair_queue). It returns a `PlanRequest` for kvcache_svc
   only when something there must change (`_needs_plan`): an admission, a request that needs
   a block it does not hold, frees that are due; None otherwise, and the step runs on the
   blocks the requests hold. A plan grows each of its requests a few blocks ahead
   (`KvBlocks.lookahead`, while the pool has room), so steady decodes make no plan call for
   many steps; the block hashes that became full wait for the next plan (a request being
   freed commits its last ones first: `CommitOp`), and so do finished requests' frees.
2. `apply_plan(reply)` takes what kvcache_svc granted (scheduler_svc.engine.granted, per
   request; `reply` None: no plan was needed) and returns the workers' `StepInput` diff
   (None: nothing runs). `num_computed_tokens` advances.
3. `update(output)` / `update_packed(output, packer)` append sampled tokens, check
   token-level stop conditions, and give the front ends their outputs; `fail_step(step_id,
   error)` instead when the worker could not run the step (its requests end with an error).
   These live in the base class, scheduler_svc.engine.step_results.

The plan's grows ahead, commits and frees are kept by scheduler_svc.engine.plan_book; steady
decodes' compact rows and their slots by scheduler_svc.engine.decode_rows.

Finished ids reach the workers with the next step that runs anything; they alone never make
a step (an idle replica sends nothing once its last frees are planned). The free-block count
is an estimate between plans (blocks shared through the prefix cache free nothing when one
holder lets go); kvcache_svc is the authority: a grow it refuses simply does not run this
step, and the next plan starts from its exact count.

KV groups (services.kv_groups): a request holds one block table per group; a grow appends to
each, and a sliding group gives back the blocks its window left (kvcache_svc does it, from the
grow's `num_computed_tokens`; the scheduler mirrors it with the same `first_kept_block`, so its
estimates count a sliding group's blocks as bounded by the window).
"""

from dataclasses import dataclass

from scheduler_svc.engine.chunking import Chunking
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.decode_rows import DecodeRowBook
from scheduler_svc.engine.fair_queue import SCHEDULING_POLICIES, FairQueue, slots_to_share
from scheduler_svc.engine.granted import apply_admission, apply_grow
from scheduler_svc.engine.kv_blocks import KvBlocks
from scheduler_svc.engine.plan_book import Grow, PlanBook
from scheduler_svc.engine.request import Request, RequestOutput, RequestStatus
from scheduler_svc.engine.step_results import StepResults
from scheduler_svc.engine.steps_in_flight import StepsInFlight
from scheduler_svc.engine.stops import final_output
from scheduler_svc.engine.store_loads import StoreLoads
from services.kv_wire import (
    AdmitOp,
    AdmitResult,
    PlanReply,
    PlanRequest,
)
from services.wire import (
    NewRequest,
    RunningRequest,
    StepInput,
    TokenMask,
)


@dataclass(slots=True)
class _Draft:
    """What `schedule()` drafted (and asked kvcache_svc for), kept until the reply comes."""
    plan: PlanRequest | None               # None: the step needs no plan call
    grows: list[Grow]
    admit_reqs: list[Request]              # per admit op


class Scheduler(StepResults):
    def __init__(self, config: SchedulerConfig, replica_id: int = 0, *,
                 ship_sampled_tokens: bool = False, num_batches: int = 1,
                 async_scheduling: bool = False, compact_decodes: bool = True) -> None:
        """`ship_sampled_tokens`: PP > 1 (non-last ranks need the sampled tokens). `num_batches`:
        the PP batch queue's depth (disjoint batches, each at most 1/num_batches of the live
        requests). `async_scheduling` (PP = 1): a decode may run again while its last token is
        still being sampled (the worker feeds its own sample in)."""
        if num_batches < 1:
            raise ValueError(f"num_batches must be at least 1, got {num_batches}")
        if config.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                             f"{config.scheduling_policy!r}")
        self.config = config
        self.replica_id = replica_id
        self.requests: dict[str, Request] = {}
        # Admitted in turn by client, or in order of arrival (fair_queue.py)
        self.waiting = FairQueue(fair=config.scheduling_policy == "fair")
        self.running: list[Request] = []
        self.num_free_blocks = 0            # as of the last plan reply
        self.num_total_blocks = 0
        self._finished_ids: list[str] = []  # requests whose worker state must be dropped
        self._new_token_ids: dict[str, list[int]] = {}  # sampled since last step (PP > 1)
        self.ship_sampled_tokens, self.num_batches = ship_sampled_tokens, num_batches
        # Not with pipeline stages: the last could not tell another's load came back short.
        self._layerwise_loads = config.layerwise_loads and not ship_sampled_tokens
        self.async_scheduling = async_scheduling
        self.in_flight = StepsInFlight()    # steps sent, output not back (steps_in_flight.py)
        self._draft: _Draft | None = None
        self._step_id = 0
        # Steady decodes travel as packed rows named by slot (services.wire.DecodeRows);
        # off, every running request is a RunningRequest (the reference path).
        self.compact_decodes = compact_decodes and not ship_sampled_tokens
        self.decode_rows = DecodeRowBook()
        self.num_preemptions = 0
        self.loads = StoreLoads()           # KV loaded from the store (store_loads.py)
        self.kv_blocks = KvBlocks(config)    # what steps take over the KV groups
        # Grows ahead, commits and frees for kvcache_svc (plan_book.py)
        self.plans = PlanBook(replica_id, self.kv_blocks, config.prefix_caching)
        self.chunking = Chunking(config)     # a request's tokens per step (chunking.py)
        self.num_prompt_tokens_admitted = 0
        self.num_cached_tokens_admitted = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queues a request, or raises ValueError if it can never run here: its id is live,
        or it needs more KV blocks than the pool has. Such a request would be admitted, grow
        until the pool is full, preempt itself and never fit again (the frontend refuses it
        up front once it knows the pool; a request parked before any replica came up, or
        moved to a smaller replica, is caught here)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        pool_tokens = self.max_request_tokens()
        if request.max_num_tokens > pool_tokens:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) needs {request.max_num_tokens} tokens of KV "
                f"cache; this replica's pool holds {pool_tokens} tokens ({self.num_total_blocks} "
                f"blocks of {self.config.block_size})")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finishes a live request with reason ABORT; None if it is not live."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._end(request)
        return final_output(request, [], [])

    # Pending finished ids count for neither: they ride on the next step that runs a request
    # (counting them kept an idle replica drafting empty plans forever).
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.plans.pending())

    def has_schedulable(self) -> bool:
        """Something a new step could carry: waiting or idle running requests, or frees
        that are due."""
        return bool(self.waiting or self._frees_due()
                    or any(self._schedulable(r) for r in self.running))

    def _schedulable(self, request: Request) -> bool:
        """Idle, or (async) decoding with its one pending token not yet past max tokens. A
        request with a grammar waits for its token: its next step's mask depends on it."""
        if not request.in_flight:
            return True
        return (self.async_scheduling and request.grammar is None
                and request.num_in_flight == 1
                and request.num_pending_tokens == 1
                and request.num_computed_tokens == request.num_tokens
                and request.num_tokens + 1 < request.max_num_tokens)

    def set_capacity(self, num_blocks: int) -> None:
        """The pool holds `num_blocks` blocks including the null block 0."""
        self.num_total_blocks = num_blocks - 1
        self.num_free_blocks = num_blocks - 1

    def max_request_tokens(self) -> int:
        """The longest request (prompt + outputs) whose blocks fit the pool in its largest
        step, every KV group counted."""
        return self.kv_blocks.max_request_tokens(self.num_total_blocks,
                                                 self.chunking.max_step_tokens())

    def discard_draft(self) -> None:
        """The plan call failed: nothing of the drafted plan happened."""
        self._draft = None

    def preempt_all(self) -> None:
        """kvcache_svc lost its state: every running request goes back to waiting.

        The caller lets the steps in flight finish first; any still recorded are forgotten
        here, and with them what they hold of each request's in-flight counters (a late
        output of such a step is then ignored by `update`)."""
        self.in_flight.leave_all()
        self.loads.forget()
        self.decode_rows.forget()
        for request in reversed(self.running):
            self._preempt(request, release_blocks=False)
        self.running.clear()
        self.plans.clear()
        self.num_free_blocks = self.num_total_blocks

    # ------------------------------------------------------------------ phase 1: draft a plan

    def schedule(self) -> PlanRequest | None:
        """Drafts the next step; the plan kvcache_svc must apply first, or None when the step
        runs on blocks the requests already hold (module docstring)."""
        cfg = self.config
        budget = cfg.token_budget
        free = self.num_free_blocks
        grows: list[Grow] = []
        must_plan = False
        preempted = False
        # Every slot taken, and a waiting client holds fewer than another: that one gives
        # up its newest slots to it (fair_queue.slots_to_share), admitted below; one still
        # in a step in flight sits this step out, to give its slot up at the next.
        shared, holding = slots_to_share(self.waiting, self.running, cfg.max_num_seqs)
        for victim in shared:
            free += victim.num_held_blocks
            self.running.remove(victim)
            self._preempt(victim, release_blocks=True, own_turn=True)

        # Requests in a step still in flight are not touched (their next tokens are unknown and
        # their blocks are being written), except decodes under async scheduling.
        queue = [r for r in self.running if self._schedulable(r) and r not in holding]
        max_requests = cfg.max_num_seqs
        if self.num_batches > 1 and not self.async_scheduling:
            max_requests = -(-(len(self.running) + len(self.waiting)) // self.num_batches)
        i = 0
        while i < len(queue) and budget > 0 and len(grows) < max_requests:
            request = queue[i]
            num_new = self.chunking.num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            needed = self.kv_blocks.grow_cost(request, num_new)
            while needed > free:
                if queue[-1].in_flight:   # its blocks are in use by a step in flight
                    break
                victim = queue.pop()       # the latest arrival gives its blocks back
                free += victim.num_held_blocks
                self._preempt(victim, release_blocks=True)
                self.running.remove(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            if needed > free:
                i += 1
                continue
            free -= needed
            budget -= num_new
            must_plan = must_plan or needed > 0 or self.kv_blocks.must_grow(
                request, num_new) or self.kv_blocks.commits_due(request, num_new)
            grows.append(Grow(request, num_new))
            i += 1

        admit_reqs: list[Request] = []
        admits: list[AdmitOp] = []
        # After a preemption nothing new is admitted this step (the pool is under pressure).
        num_slots = min(cfg.max_num_seqs - len(self.running), max_requests - len(grows))
        for request in self.waiting if not preempted else ():
            if len(admits) >= num_slots or budget <= 0:
                break
            num_tokens = request.num_tokens
            max_new = self.chunking.admit_tokens(num_tokens, budget)
            if max_new is None:
                break
            needed = self.kv_blocks.admit_cost(max_new)
            if needed > free:
                break
            free -= needed
            budget -= max_new
            admit_reqs.append(request)
            admits.append(AdmitOp(request_id=request.request_id, num_tokens=num_tokens,
                                  block_hashes=list(request.block_hashes),
                                  max_num_new_tokens=max_new,
                                  allow_partial=cfg.chunked_prefill,
                                  tail_hash=request.tail_hash(),
                                  compute_after_load=self._layerwise_loads))

        if not (must_plan or admits or preempted or shared or self._frees_due()):
            self._draft = _Draft(None, grows, [])
            return None
        plan = self.plans.plan(grows, admits, free, self.num_total_blocks)
        self._draft = _Draft(plan, grows, admit_reqs)
        return plan

    def _frees_due(self) -> bool:
        return self.plans.frees_due(bool(self.running) and not self.waiting,
                                    self.num_free_blocks, self.num_total_blocks)

    def _preempt(self, request: Request, release_blocks: bool, own_turn: bool = False) -> None:
        """Back to waiting, recomputed when admitted again: before every other request (for
        memory), or (`own_turn`: its slot went to another client) first of its client's."""
        if release_blocks:
            self.plans.release(request, commit=True)
        if request.on_worker:
            self._drop_on_worker(request)
        self._new_token_ids.pop(request.request_id, None)
        request.reset_for_preemption()
        (self.waiting.putback if own_turn else self.waiting.appendleft)(request)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ phase 2: apply reply

    def apply_plan(self, reply: PlanReply | None) -> StepInput | None:
        """Commits what kvcache_svc granted (`reply`; None when the draft needed no plan); the
        StepInput to run, or None if nothing runs."""
        draft, self._draft = self._draft, None
        if draft is None or (reply is None) != (draft.plan is None) or (
                reply is not None and draft.plan is not None
                and reply.plan_id != draft.plan.plan_id):
            raise RuntimeError("plan reply does not match the drafted plan")
        grown: list[list[list[int]] | None] = []
        admitted: list[AdmitResult] = []
        if reply is not None:
            if reply.error is not None:
                raise RuntimeError(f"kvcache_svc refused the plan: {reply.error}")
            if len(reply.grown) != sum(g.op is not None for g in draft.grows):
                raise RuntimeError("plan reply answers another number of grows")
            self.num_free_blocks = reply.num_free_blocks
            grown, admitted = reply.grown, reply.admitted

        running: list[RunningRequest] = []
        decodes: list[Request] = []
        decode_computed: list[int] = []
        committing: set[str] = set()
        no_blocks = [[] for _ in range(self.kv_blocks.num_groups)]
        for grow in draft.grows:
            request, num_new = grow.request, grow.num_new
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted or ended meanwhile
            new_blocks: list[list[int]] | None = no_blocks
            if grow.op is not None:
                new_blocks = grown[grow.op]
                if new_blocks is None:
                    continue  # did not fit this step; it keeps its place and retries
                self.kv_blocks.grown(request, new_blocks)
                request.num_committed_blocks += grow.num_commits
                if grow.num_commits:
                    committing.add(request.request_id)
            if self.compact_decodes and DecodeRowBook.is_row(request, num_new, new_blocks):
                decodes.append(request)
                decode_computed.append(request.num_computed_tokens)
                request.num_computed_tokens += 1
                continue
            running.append(apply_grow(request, num_new, new_blocks,
                                      self._new_token_ids.pop(request.request_id, [])))

        new_requests: list[NewRequest] = []
        loading: list[tuple[Request, AdmitResult, bool]] = []
        for request, result in zip(draft.admit_reqs, admitted):
            if result.request_id != request.request_id:
                raise RuntimeError("plan reply admitted requests out of order")
            # Admissions are drafted from the front of the queue, in order, and the queue is
            # not touched in between: the admitted requests are exactly its first entries.
            if self.waiting[0] is not request:
                raise RuntimeError("admitted request is not at the head of the waiting queue")
            self.waiting.popleft()
            self.kv_blocks.check(result.block_ids)
            new_requests.append(apply_admission(request, result, self.decode_rows.take_slot()))
            if result.num_committed_blocks * self.config.block_size > result.num_cached_tokens:
                committing.add(request.request_id)
            first = request.num_cached_tokens is None
            if first:
                request.mark_scheduled()
                request.num_cached_tokens = result.num_cached_tokens
                self.num_prompt_tokens_admitted += request.num_prompt_tokens
                self.num_cached_tokens_admitted += result.num_cached_tokens
                self.loads.admitted(request, result.num_cached_tokens, result.num_load_tokens)
            self.running.append(request)
            if result.num_load_tokens:
                loading.append((request, result, first))

        if not running and not new_requests and not decodes:
            return None
        self._step_id += 1
        in_step = [self.requests[r.request_id] for r in running] + list(
            draft.admit_reqs[:len(admitted)]) + decodes
        entries = self.in_flight.enter(self._step_id, in_step, committing)
        masks = [TokenMask(e.request.request_id, e.request.grammar.next_token_mask())
                 for e in entries if e.samples and e.request.grammar is not None]
        self.loads.add(self._step_id, loading)
        rows = self.decode_rows.rows(self._step_id, decodes, decode_computed) if decodes \
            else None
        step = StepInput(step_id=self._step_id, new_requests=new_requests, running=running,
                         finished_ids=self._finished_ids, token_masks=masks, decodes=rows)
        self._finished_ids = []
        self.decode_rows.sent()
        return step
