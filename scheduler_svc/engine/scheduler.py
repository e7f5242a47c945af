"""Continuous batching for one replica: which requests run each step, and what comes back.

A step has three phases, and the scheduler owns the state between them (no network here):

1. `schedule()` drafts the step: grows of running requests (in arrival order, each capped by
   the token budget; when the free-block estimate runs out the latest running request is
   preempted by recompute), then admissions of waiting requests. It returns a `PlanRequest`
   for kvcache_svc only when something there must change (`_needs_plan`): an admission, a
   request that needs a block it does not hold, frees that are due; None otherwise, and the
   step runs on the blocks the requests hold. A plan grows each of its requests a few blocks
   ahead (`KvBlocks.lookahead`, while the pool has room), so steady decodes make no plan call
   for many steps; the block hashes that became full wait for the next plan (a request being
   freed commits its last ones first: `CommitOp`), and so do finished requests' frees.
2. `apply_plan(reply)` takes what kvcache_svc granted (scheduler_svc.engine.granted, per
   request; `reply` None: no plan was needed) and returns the workers' `StepInput` diff
   (None: nothing runs). `num_computed_tokens` advances.
3. `update(output)` appends sampled tokens, checks token-level stop conditions, and returns
   one `RequestOutput` per request that produced something; `fail_step(step_id, error)`
   instead when the worker could not run the step (its requests end with an error).

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

from collections import deque
from dataclasses import dataclass

import numpy as np

from scheduler_svc.engine.chunking import Chunking
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.granted import apply_admission, apply_grow
from scheduler_svc.engine.kv_blocks import KvBlocks
from scheduler_svc.engine.outputs import StepPacker, finished_record
from scheduler_svc.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from scheduler_svc.engine.steps_in_flight import StepsInFlight
from scheduler_svc.engine.stops import final_output, stop_check, token_output
from scheduler_svc.engine.store_loads import StoreLoads
from services.kv_wire import (
    AdmitOp,
    AdmitResult,
    CommitOp,
    GrowOp,
    PlanReply,
    PlanRequest,
)
from services.wire import (
    DecodeRows,
    NewRequest,
    RunningRequest,
    StepError,
    StepInput,
    StepOutput,
    TokenLogprobs,
    TokenMask,
)


def pack_int32(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def decode_tokens(output: StepOutput, num_rows: int) -> list[int]:
    """The tokens of a step's `num_rows` decode rows (-1: a row the worker skipped)."""
    if len(output.decode_token_ids) != 4 * num_rows:
        raise RuntimeError(f"step {output.step_id}: {len(output.decode_token_ids)} bytes of "
                           f"decode tokens for {num_rows} decode rows")
    return np.frombuffer(output.decode_token_ids, dtype="<i4").tolist()


# Growing ahead stops while the pool would keep less than 1/LOOKAHEAD_RESERVE of its blocks
# free; so do deferred frees (they are due then).
LOOKAHEAD_RESERVE = 8


@dataclass(slots=True)
class _Grow:
    """A running request's share of a drafted step."""
    request: Request
    num_new: int                           # tokens it computes
    op: int | None = None                  # its grow op's index in the plan (None: no op)
    num_commits: int = 0                   # block hashes its op commits


@dataclass(slots=True)
class _Draft:
    """What `schedule()` drafted (and asked kvcache_svc for), kept until the reply comes."""
    plan: PlanRequest | None               # None: the step needs no plan call
    grows: list[_Grow]
    admit_reqs: list[Request]              # per admit op


class Scheduler:
    def __init__(self, config: SchedulerConfig, replica_id: int = 0, *,
                 ship_sampled_tokens: bool = False, num_batches: int = 1,
                 async_scheduling: bool = False, compact_decodes: bool = True) -> None:
        """`ship_sampled_tokens`: PP > 1 (non-last ranks need the sampled tokens). `num_batches`:
        the PP batch queue's depth (disjoint batches, each at most 1/num_batches of the live
        requests). `async_scheduling` (PP = 1): a decode may run again while its last token is
        still being sampled (the worker feeds its own sample in)."""
        if num_batches < 1:
            raise ValueError(f"num_batches must be at least 1, got {num_batches}")
        self.config = config
        self.replica_id = replica_id
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_free_blocks = 0            # as of the last plan reply
        self.num_total_blocks = 0
        self._free_ids: list[str] = []      # requests whose blocks kvcache_svc must release
        self._commits: list[CommitOp] = []  # their last full blocks, committed before that
        self._finished_ids: list[str] = []  # requests whose worker state must be dropped
        self._new_token_ids: dict[str, list[int]] = {}  # sampled since last step (PP > 1)
        self.ship_sampled_tokens, self.num_batches = ship_sampled_tokens, num_batches
        # Not with pipeline stages: the last could not tell another's load came back short.
        self._layerwise_loads = config.layerwise_loads and not ship_sampled_tokens
        self.async_scheduling = async_scheduling
        self.in_flight = StepsInFlight()    # steps sent, output not back (steps_in_flight.py)
        self._draft: _Draft | None = None
        self._plan_id = 0
        self._step_id = 0
        # Steady decodes travel as packed rows named by slot (services.wire.DecodeRows);
        # off, every running request is a RunningRequest (the reference path).
        self.compact_decodes = compact_decodes and not ship_sampled_tokens
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._releasing: list[int] = []     # slots of dropped requests, free once sent
        self._decode_rows: dict[int, list[Request]] = {}   # step id -> its decode rows
        self.num_preemptions = 0
        self.loads = StoreLoads()           # KV loaded from the store (store_loads.py)
        self.kv_blocks = KvBlocks(config)    # what steps take over the KV groups
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
        return bool(self.waiting or self.running or self._free_ids or self._commits)

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
        self._decode_rows.clear()
        for request in reversed(self.running):
            self._preempt(request, release_blocks=False)
        self.running.clear()
        self._free_ids.clear()
        self._commits.clear()
        self.num_free_blocks = self.num_total_blocks

    # ------------------------------------------------------------------ phase 1: draft a plan

    def schedule(self) -> PlanRequest | None:
        """Drafts the next step; the plan kvcache_svc must apply first, or None when the step
        runs on blocks the requests already hold (module docstring)."""
        cfg = self.config
        budget = cfg.token_budget
        free = self.num_free_blocks
        grows: list[_Grow] = []
        must_plan = False
        preempted = False

        # Requests in a step still in flight are not touched (their next tokens are unknown and
        # their blocks are being written), except decodes under async scheduling.
        queue = [r for r in self.running if self._schedulable(r)]
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
            grows.append(_Grow(request, num_new))
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

        if not (must_plan or admits or preempted or self._frees_due()):
            self._draft = _Draft(None, grows, [])
            return None
        grow_ops = self._grow_ops(grows, free)
        self._plan_id += 1
        plan = PlanRequest(replica_id=self.replica_id, plan_id=self._plan_id,
                           free_ids=self._free_ids, grows=grow_ops, admits=admits,
                           commits=self._commits)
        self._free_ids, self._commits = [], []
        self._draft = _Draft(plan, grows, admit_reqs)
        return plan

    def _grow_ops(self, grows: list[_Grow], free: int) -> list[GrowOp]:
        """The plan's grow ops: every request of the step that needs a block or has block
        hashes to commit, and, while the pool has room to spare (`free` estimated after the
        step's own needs), every one that would run out within `KvBlocks.lookahead` tokens,
        grown that far ahead (so the next plan is that many steps away)."""
        ops: list[GrowOp] = []
        spare = free - self.num_total_blocks // LOOKAHEAD_RESERVE
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

    def _frees_due(self) -> bool:
        """Frees go with the next plan a step needs anyway, unless nothing else runs (an
        idle replica gives its blocks back at once) or the pool runs low."""
        return bool(self._free_ids or self._commits) and (
            not self.running or bool(self.waiting)
            or self.num_free_blocks < self.num_total_blocks // LOOKAHEAD_RESERVE)

    def _final_commits(self, request: Request) -> None:
        """The block hashes of a request about to be freed that became full since its last
        plan (kvcache_svc enters them first, so they stay cached): only blocks no step in
        flight is still writing."""
        if not self.config.prefix_caching or not request.block_ids:
            return
        end = request.num_computed_tokens - (1 if request.in_flight else 0)
        commits = self.kv_blocks.hashes_to_commit(request, end)
        if commits:
            self._commits.append(CommitOp(request.request_id, commits))
            request.num_committed_blocks += len(commits)

    def _preempt(self, request: Request, release_blocks: bool) -> None:
        if release_blocks:
            self._final_commits(request)
            self._free_ids.append(request.request_id)
        if request.on_worker:
            self._drop_on_worker(request)
        self._new_token_ids.pop(request.request_id, None)
        request.reset_for_preemption()
        self.waiting.appendleft(request)
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
            if (self.compact_decodes and num_new == 1 and request.slot >= 0
                    and not any(new_blocks) and request.sampling.logprobs is None
                    and request.num_computed_tokens + 1
                    == request.num_tokens + request.num_pending_tokens):
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
            new_requests.append(apply_admission(request, result, self._take_slot()))
            if result.num_committed_blocks * self.config.block_size > result.num_cached_tokens:
                committing.add(request.request_id)
            first = request.num_cached_tokens is None
            if first:
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
        rows = None
        if decodes:
            self._decode_rows[self._step_id] = decodes
            rows = DecodeRows(slots=pack_int32([r.slot for r in decodes]),
                              num_computed_tokens=pack_int32(decode_computed))
        step = StepInput(step_id=self._step_id, new_requests=new_requests, running=running,
                         finished_ids=self._finished_ids, token_masks=masks, decodes=rows)
        self._finished_ids = []
        # The workers drop those ids' state before this step's new requests: their slots
        # may be given again from the next step on.
        self._free_slots += self._releasing
        self._releasing = []
        return step

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        return slot

    # ------------------------------------------------------------------ phase 3: outputs

    def _sampled(self, output: StepOutput) -> list[tuple[str, int, TokenLogprobs | None]]:
        """Every (request id, token, logprobs) the step sampled, its decode rows' included."""
        rows = list(zip(output.request_ids, output.sampled_token_ids, output.logprobs,
                        strict=True))
        decodes = self._decode_rows.pop(output.step_id, [])
        tokens = decode_tokens(output, len(decodes))
        rows += [(r.request_id, t, None) for r, t in zip(decodes, tokens, strict=True)
                 if t >= 0]
        return rows

    def update(self, output: StepOutput) -> list[RequestOutput]:
        sampling_ids = {e.request.request_id
                         for e in self.in_flight.leave(output.step_id) if e.samples}
        outputs: list[RequestOutput] = []
        for chunk in output.prompt_logprobs:
            if (request := self.requests.get(chunk.request_id)) is not None:
                request.add_prompt_logprobs(chunk.first_position, chunk.logprobs, chunk.ranks)
        for request_id, token_id, logprobs in self._sampled(output):
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran: the token is dropped
            if request_id not in sampling_ids:
                continue  # a non-final prefill chunk (the worker should not sample those)
            request.append_token(token_id)
            if self.ship_sampled_tokens:
                self._new_token_ids.setdefault(request_id, []).append(token_id)
            outputs.append(self._after_token(request, token_id, logprobs))
            if request.num_output_tokens == 1:
                outputs[-1].prompt_logprobs = request.prompt_logprobs_output()
        return outputs

    def update_packed(self, output: StepOutput, packer: StepPacker) -> None:
        """`update`, its outputs put straight into `packer` (scheduler_svc.engine.outputs):
        a row per token, a record only for an ending, logprobs or prompt logprobs. What the
        engine core runs every step; `update` is its reference (the same messages, the same
        state after: tests/scheduler_svc/engine/test_packed_path.py)."""
        sampling_ids = {e.request.request_id
                        for e in self.in_flight.leave(output.step_id) if e.samples}
        for chunk in output.prompt_logprobs:
            if (request := self.requests.get(chunk.request_id)) is not None:
                request.add_prompt_logprobs(chunk.first_position, chunk.logprobs, chunk.ranks)
        requests = self.requests
        running = RequestStatus.RUNNING
        ship = self.ship_sampled_tokens
        for request_id, token_id, logprobs in self._sampled(output):
            request = requests.get(request_id)
            if request is None or request.status is not running:
                continue  # aborted or preempted while the step ran: the token is dropped
            if request_id not in sampling_ids:
                continue  # a non-final prefill chunk (the worker should not sample those)
            token_ids = request.token_ids
            token_ids.append(token_id)
            num_tokens = len(token_ids)
            if request.hash_blocks and num_tokens % request.block_size == 0:
                request._extend_hashes()
            if ship:
                self._new_token_ids.setdefault(request_id, []).append(token_id)
            out = packer.of(request.frontend)
            out.token(request.handle, token_id, logprobs)
            num_output = num_tokens - request.num_prompt_tokens
            if num_output == 1 and request.sampling.prompt_logprobs is not None:
                out.prompt(request.handle, request.prompt_logprobs_output() or [])
            # The endings of stops.stop_check, then the grammar's.
            sampling = request.sampling
            reason: FinishReason | None = None
            stop_token: int | None = None
            if num_output >= sampling.min_tokens:
                if not sampling.ignore_eos and token_id in request.eos_token_ids:
                    reason = FinishReason.STOP
                elif token_id in sampling.stop_token_ids:
                    reason, stop_token = FinishReason.STOP, token_id
            if reason is None and num_tokens >= request.max_num_tokens:
                reason = FinishReason.LENGTH
            if (reason is None and request.grammar is not None
                    and request.grammar.advance(token_id)):
                reason = FinishReason.STOP      # the grammar is complete
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason, stop_token)
                out.finished.append(finished_record(final_output(request, [], [])))

    def fail_step(self, step_id: int, error: StepError) -> tuple[list[RequestOutput], bool]:
        """The worker could not run step `step_id` and dropped that step's requests (it skips
        them in later steps already sent): each live one ends with `error` and gives its
        blocks back. Returns their final outputs, and whether the prefix index may now hold
        blocks whose KV was never written (the caller must then empty the index)."""
        entries, poisoned = self.in_flight.leave_failed(step_id, error.kv_written)
        poisoned = poisoned and self.config.prefix_caching
        self.loads.forget(step_id)
        self._decode_rows.pop(step_id, None)
        outputs = []
        for e in entries:
            request = e.request
            if self.requests.get(request.request_id) is not request:
                continue  # finished or aborted while the step ran
            self._end(request)
            final = final_output(request, [], [])
            final.error = f"the worker failed a step of this request: {error.message}"
            final.server_fault = True
            outputs.append(final)
        return outputs, poisoned

    def _after_token(self, request: Request, token_id: int,
                     logprobs: TokenLogprobs | None) -> RequestOutput:
        reason, stop_reason = stop_check(request, token_id)
        if reason is None and request.grammar is not None and request.grammar.advance(token_id):
            reason = FinishReason.STOP      # the grammar is complete
        if reason is not None:
            self.running.remove(request)
            self._finish(request, reason, stop_reason)
            return final_output(request, [token_id], [logprobs])
        return token_output(request, token_id, logprobs)

    def _end(self, request: Request) -> None:
        """A live request leaves its queue and finishes with reason ABORT."""
        (self.waiting if request.status is RequestStatus.WAITING else self.running).remove(
            request)
        self._finish(request, FinishReason.ABORT, None)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None,
                ) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request.block_ids:
            if reason is not FinishReason.ABORT:
                self._final_commits(request)
            self._free_ids.append(request.request_id)
        if request.on_worker:
            self._drop_on_worker(request)
        self._new_token_ids.pop(request.request_id, None)
        del self.requests[request.request_id]

    def _drop_on_worker(self, request: Request) -> None:
        """The workers drop its state with the next step (its slot is free after that)."""
        self._finished_ids.append(request.request_id)
        if request.slot >= 0:
            self._releasing.append(request.slot)
            request.slot = -1
