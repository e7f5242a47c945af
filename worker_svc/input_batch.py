"""The worker's persistent per-request state, and applying a `StepInput` diff to it.

The runner calls `InputBatch.apply(step)` at the start of every step. The diff is applied in
field order: `finished_ids` drop their state (ids the worker does not hold are ignored: a
request preempted earlier may be named again when it finishes), `new_requests` bring full
state, `running` requests take their appended block ids, their `num_computed_tokens` and any
`new_token_ids` (tokens sampled by the last stage, written at `num_computed_tokens`: this is
how non-last pipeline ranks learn them; the last stage already holds them), and `decodes`
(services.wire.DecodeRows: steady decodes named by their `NewRequest.slot`, as packed arrays)
each compute the one token at the end of what is held for them.

The whole diff is validated before anything changes, so a bad diff raises `ValueError` and
leaves the state as it was.

Block ids come one list per KV group (services.kv_groups), in the layout's group order. A
sliding group's table may start with the null block 0 (a prefix hit or a resume reuses only
the blocks its window reads); blocks kvcache_svc gives back later keep their old ids here,
which is harmless: no kernel reads a block wholly before a row's window.

When a step fails part way (a one-rank replica), the runner calls `discard(step)`: the step's
requests are forgotten, and later steps, sent before the scheduler learnt of the failure, may
still name them as running: such entries are skipped until the ids come back as finished.

Every held request also has a row of the persistent block tables (`tables`, worker_svc.
block_tables), kept in step with its `block_ids`: a step's attention metadata is gathered from
them with a few array operations.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.wire import MAX_SLOTS, NewRequest, RunningRequest, SamplingSpec, StepInput
from worker_svc.attention import AttentionMetadata, build_kernel_metadata
from worker_svc.block_tables import BlockTables
from worker_svc.sampler import SeededUniforms, is_greedy, is_plain_greedy, new_generator


class RequestState:
    """What the worker knows about one request between steps."""

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "block_ids",
                 "num_computed_tokens", "sampling", "generator", "cache_salt",
                 "num_saved_tokens", "save_from", "block_hashes", "load_start", "row",
                 "plain_greedy", "slot")

    def __init__(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                 block_ids: list[list[int]], num_computed_tokens: int, sampling: SamplingSpec,
                 generator: SeededUniforms | None, cache_salt: bytes = b"", slot: int = -1):
        self.request_id = request_id
        self.token_ids = token_ids                    # prompt + outputs known to this worker
        self.num_prompt_tokens = num_prompt_tokens
        self.block_ids = block_ids                    # per KV group, blocks in token order
        # Tokens whose KV is in the cache once the current step has run.
        self.num_computed_tokens = num_computed_tokens
        self.sampling = sampling
        self.generator = generator                    # seeded requests that sample (not greedy)
        self.cache_salt = cache_salt                  # enters block 0's hash (block_hash.py)
        # KV store saving (worker_svc.kv_saver): tokens handed to the saver (copied or
        # skipped; -1 until its first step with a saver), the first token of the run this
        # saver copied out without a gap (a later piece of a window it covers from the
        # window's start is sent as an extension), and the chained hashes of the leading full
        # blocks keyed so far.
        self.num_saved_tokens = -1
        self.save_from = 0
        self.block_hashes: list[bytes] = []
        # Loading from the KV store (worker_svc.kv_loader): where the load began. Its next
        # step may resume anywhere from here to the load's end (the scheduler resumes after
        # what every rank loaded); None once it has.
        self.load_start: int | None = None
        self.row = -1            # its row of the batch's block tables (-1: none yet)
        # Greedy with nothing else to compute (worker_svc.sampler.is_plain_greedy), once.
        self.plain_greedy = is_plain_greedy(sampling)
        self.slot = slot         # the replica's name for it (NewRequest.slot; -1: none)


@dataclass(slots=True, eq=False)
class ScheduledRequest:
    """One request's share of a step (made for every row of every step: a plain slotted
    class, not a frozen one, whose construction costs several times as much)."""

    state: RequestState
    num_computed_tokens: int      # tokens already cached before this step
    num_new_tokens: int           # tokens computed this step
    # The step reaches the last known token, so it samples the next one; a non-final prefill
    # chunk does not.
    samples: bool
    decode_row: int = -1          # its row among the step's DecodeRows (-1: not one)


@dataclass(slots=True)
class _RunningUpdate:
    state: RequestState
    request: RunningRequest
    samples: bool


class InputBatch:
    """Requests held by this worker, keyed by request id."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, max_model_len: int,
                 kv_windows: Sequence[int] = (0,)):
        """`kv_windows`: the model's KV groups' windows (`KvGroupLayout.windows`)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_windows = tuple(kv_windows)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self.discarded_ids: set[str] = set()   # dropped by a failed step, not yet finished
        self.tables = BlockTables(len(self.kv_windows))   # every held request's, by row
        self.slots: list[RequestState | None] = []        # held requests by NewRequest.slot
        # Slots of requests a failed step dropped, until their finished ids come: decode
        # rows naming them are skipped, as running requests of those ids are.
        self.discarded_slots: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def apply(self, step: StepInput) -> list[ScheduledRequest]:
        """Apply the diff; return the step's requests in step order (new, running, then
        decode rows)."""
        finished = set(step.finished_ids)
        held = self.requests.keys() - finished
        seen: set[str] = set()
        new_states = [self._check_new(r, held, seen) for r in step.new_requests]
        skipped = self.discarded_ids - finished
        updates = [self._check_running(r, held, seen) for r in step.running
                   if r.request_id not in skipped]
        decodes = self._check_decodes(step, finished, seen, skipped)

        for request_id in step.finished_ids:
            self._drop(request_id)
            self.discarded_slots.pop(request_id, None)
        self.discarded_ids -= finished
        scheduled = []
        for request, state in zip(step.new_requests, new_states, strict=True):
            self.requests[request.request_id] = state
            state.row = self.tables.add(state.block_ids)
            if state.slot >= 0:
                self._hold_slot(state)
            start = request.num_computed_tokens
            if request.num_load_tokens:      # its KV past `start` loads (worker_svc.kv_loader)
                state.load_start = start
                start += request.num_load_tokens
                state.num_computed_tokens = start
                if not request.num_new_tokens:
                    continue                 # a background load: computes nothing this step
            # Else a layer-wise load: this step computes on from the loaded tokens.
            scheduled.append(self._schedule(state, start, request.num_new_tokens))
        for update in updates:
            state, request = update.state, update.request
            if any(request.new_block_ids):
                for ids, new_ids in zip(state.block_ids, request.new_block_ids, strict=True):
                    ids += new_ids
                self.tables.append(state.row, request.new_block_ids)
            start = request.num_computed_tokens
            state.token_ids[start:start + len(request.new_token_ids)] = request.new_token_ids
            state.load_start = None
            scheduled.append(self._schedule(state, start, request.num_new_tokens))
        for row, state in enumerate(decodes):
            if state is not None:
                start = len(state.token_ids) - 1
                state.num_computed_tokens = start + 1
                state.load_start = None
                scheduled.append(ScheduledRequest(state, start, 1, True, row))
        return scheduled

    def _check_decodes(self, step: StepInput, finished: set[str], seen: set[str],
                       skipped: set[str]) -> list[RequestState | None]:
        """The states of the step's decode rows, in order (None: a row to skip, its request
        dropped by a failed step). Each must be held (and not finished by this step), named
        once in the step, and compute the one token at the end of what this worker holds."""
        rows = step.decodes
        if rows is None:
            return []
        slots = np.frombuffer(rows.slots, dtype="<i4")
        computed = np.frombuffer(rows.num_computed_tokens, dtype="<i4")
        if len(rows.slots) % 4 or len(slots) != len(computed) or len(rows.num_computed_tokens) % 4:
            raise ValueError(f"decode rows: {len(rows.slots)} bytes of slots and "
                             f"{len(rows.num_computed_tokens)} of counts are not one int32 each")
        if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= MAX_SLOTS):
            raise ValueError(f"decode rows: a slot outside [0, {MAX_SLOTS})")
        slot_list = slots.tolist()
        if len(set(slot_list)) != len(slot_list):
            raise ValueError("decode rows: a slot named twice in one step")
        skipped_slots = {self.discarded_slots[rid] for rid in skipped
                         if rid in self.discarded_slots}
        states: list[RequestState | None] = []
        by_slot, block_size, max_len = self.slots, self.block_size, self.max_model_len
        num_slots = len(by_slot)
        # A slot names one held request (`_drop` empties it), so distinct slots are distinct
        # requests; `seen` holds the step's new and running ones.
        for slot, start in zip(slot_list, computed.tolist(), strict=True):
            state = by_slot[slot] if slot < num_slots else None
            if state is None or (finished and state.request_id in finished):
                if slot in skipped_slots:
                    states.append(None)
                    continue
                raise ValueError(f"decode row of slot {slot}: no request held there")
            if seen and state.request_id in seen:
                raise ValueError(f"request {state.request_id!r} appears twice in one step")
            end = start + 1
            num_tokens = len(state.token_ids)
            if start != state.num_computed_tokens or end != num_tokens:
                # After a load, from any point of it (what every rank got), as a running one.
                lowest = state.num_computed_tokens if state.load_start is None else \
                    state.load_start
                if not lowest <= start <= state.num_computed_tokens or end != num_tokens:
                    raise ValueError(f"request {state.request_id!r}: a decode row from {start}, "
                                     f"but this worker has computed {state.num_computed_tokens} "
                                     f"of {num_tokens} known tokens")
            if end > max_len or end > len(state.block_ids[0]) * block_size:
                self._check_span(state.request_id, start, 1, num_tokens,
                                 len(state.block_ids[0]))
            states.append(state)
        return states

    def _hold_slot(self, state: RequestState) -> None:
        slots = self.slots
        if state.slot >= len(slots):
            slots.extend([None] * (state.slot + 1 - len(slots)))
        slots[state.slot] = state

    def discard(self, step: StepInput) -> None:
        """`step` failed after (or while) applying it: drop its finished ids and every request
        it names (their state may be half-updated; the scheduler fails them)."""
        for request_id in step.finished_ids:
            self._drop(request_id)
            self.discarded_slots.pop(request_id, None)
        self.discarded_ids -= set(step.finished_ids)
        named = [r.request_id for r in [*step.new_requests, *step.running]]
        if step.decodes is not None:
            slots = np.frombuffer(step.decodes.slots, dtype="<i4").tolist()
            named += [state.request_id for slot in slots
                      if 0 <= slot < len(self.slots) and (state := self.slots[slot]) is not None]
        for request_id in named:
            state = self.requests.get(request_id)
            if state is not None and state.slot >= 0:
                self.discarded_slots[request_id] = state.slot
            self._drop(request_id)
            self.discarded_ids.add(request_id)

    def _drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        if state.row >= 0:
            self.tables.free(state.row)
            state.row = -1
        if 0 <= state.slot < len(self.slots) and self.slots[state.slot] is state:
            self.slots[state.slot] = None

    @staticmethod
    def _schedule(state: RequestState, num_computed: int, num_new: int) -> ScheduledRequest:
        state.num_computed_tokens = num_computed + num_new
        return ScheduledRequest(state, num_computed, num_new,
                                samples=num_computed + num_new == len(state.token_ids))

    # ------------------------------------------------------------------------------ validation

    def _check_new(self, request: NewRequest, held: set[str], seen: set[str]) -> RequestState:
        rid = request.request_id
        self._check_id_once(rid, seen)
        if rid in held:
            raise ValueError(f"new request {rid!r} is already held by this worker")
        slot = request.slot
        if slot >= 0:
            holder = self.slots[slot] if slot < len(self.slots) else None
            if (holder is not None and holder.request_id in held) or f"#slot{slot}" in seen:
                raise ValueError(f"new request {rid!r}: slot {slot} is taken")
            seen.add(f"#slot{slot}")
        num_tokens = len(request.token_ids)
        if not 0 < request.num_prompt_tokens <= num_tokens:
            raise ValueError(f"request {rid!r}: num_prompt_tokens {request.num_prompt_tokens} "
                             f"not in [1, {num_tokens}]")
        self._check_token_ids(rid, request.token_ids)
        self._check_block_ids(rid, request.block_ids, new=True)
        if request.num_new_tokens == 0 and request.num_load_tokens == 0:
            raise ValueError(f"request {rid!r}: a new request computes tokens or loads them "
                             f"(num_new_tokens and num_load_tokens are both 0)")
        self._check_span(rid, request.num_computed_tokens,
                         request.num_new_tokens + request.num_load_tokens, num_tokens,
                         len(request.block_ids[0]))
        sampling = request.sampling
        self._check_token_ids(rid, [*(t for t, _ in sampling.logit_bias), *sampling.min_tokens_ids])
        generator = None
        if sampling.seed is not None and not is_greedy(sampling):
            generator = new_generator(sampling.seed, num_tokens - request.num_prompt_tokens)
        return RequestState(rid, list(request.token_ids), request.num_prompt_tokens,
                            [list(ids) for ids in request.block_ids],
                            request.num_computed_tokens, sampling,
                            generator, request.cache_salt, slot)

    def _check_running(self, request: RunningRequest, held: set[str],
                       seen: set[str]) -> _RunningUpdate:
        rid = request.request_id
        self._check_id_once(rid, seen)
        if rid not in held:
            raise ValueError(f"running request {rid!r} is not held by this worker")
        state = self.requests[rid]
        start = request.num_computed_tokens
        new_block_ids = request.new_block_ids
        if (not request.new_token_ids and state.load_start is None
                and start == state.num_computed_tokens
                and len(new_block_ids) == len(self.kv_windows) and not any(new_block_ids)):
            # Most decode steps: where it was, nothing appended; only the span to check.
            end = start + request.num_new_tokens
            num_tokens = len(state.token_ids)
            if (end > num_tokens or end > self.max_model_len
                    or end > len(state.block_ids[0]) * self.block_size):
                self._check_span(rid, start, request.num_new_tokens, num_tokens,
                                 len(state.block_ids[0]))
            return _RunningUpdate(state, request, end == num_tokens)
        # After a load, any point of it (what every rank got); otherwise exactly where it is.
        lowest = state.num_computed_tokens if state.load_start is None else state.load_start
        if not lowest <= start <= state.num_computed_tokens:
            raise ValueError(f"request {rid!r}: num_computed_tokens {start} but this worker has "
                             f"computed {state.num_computed_tokens}")
        new_tokens = request.new_token_ids
        if new_tokens:
            if start > len(state.token_ids):
                raise ValueError(f"request {rid!r}: new tokens at {start} leave a gap after "
                                 f"the {len(state.token_ids)} known tokens")
            known = state.token_ids[start:start + len(new_tokens)]
            if known != new_tokens[:len(known)]:
                raise ValueError(f"request {rid!r}: new tokens {new_tokens} contradict the "
                                 f"known tokens {known} at {start}")
            self._check_token_ids(rid, new_tokens)
        num_tokens = max(len(state.token_ids), start + len(new_tokens))
        self._check_block_ids(rid, request.new_block_ids, new=False)
        self._check_span(rid, start, request.num_new_tokens, num_tokens,
                         len(state.block_ids[0]) + len(request.new_block_ids[0]))
        return _RunningUpdate(state, request, start + request.num_new_tokens == num_tokens)

    @staticmethod
    def _check_id_once(request_id: str, seen: set[str]) -> None:
        if request_id in seen:
            raise ValueError(f"request {request_id!r} appears twice in one step")
        seen.add(request_id)

    def _check_token_ids(self, request_id: str, token_ids: list[int]) -> None:
        if token_ids and max(token_ids) >= self.vocab_size:
            raise ValueError(f"request {request_id!r}: token id {max(token_ids)} is outside "
                             f"the vocabulary of {self.vocab_size}")

    def _check_block_ids(self, request_id: str, block_ids: list[list[int]], new: bool) -> None:
        """One list per KV group, all of one length. Block 0 is the null block: it never holds
        a real token; only a new request's sliding group may start with it (blocks its window
        no longer reads)."""
        if len(block_ids) != len(self.kv_windows):
            raise ValueError(f"request {request_id!r}: block ids for {len(block_ids)} KV "
                             f"groups; the model has {len(self.kv_windows)}")
        if not any(block_ids):
            return                            # nothing appended: most decode steps
        length = len(block_ids[0])
        for ids, window in zip(block_ids, self.kv_windows, strict=True):
            if len(ids) != length:
                raise ValueError(f"request {request_id!r}: KV groups' block lists differ in "
                                 f"length: {[len(each) for each in block_ids]}")
            if not ids:
                continue
            if new and window and not ids[0]:
                ids = ids[next((i for i, b in enumerate(ids) if b), len(ids)):]
            if ids and not (min(ids) >= 1 and max(ids) < self.num_blocks):
                raise ValueError(f"request {request_id!r}: block ids {ids} not all in "
                                 f"[1, {self.num_blocks})")

    def _check_span(self, request_id: str, num_computed: int, num_new: int, num_tokens: int,
                    num_blocks: int) -> None:
        end = num_computed + num_new
        if end > num_tokens:
            raise ValueError(f"request {request_id!r}: computing tokens up to {end} but only "
                             f"{num_tokens} are known")
        if end > self.max_model_len:
            raise ValueError(f"request {request_id!r}: {end} tokens exceed the model's "
                             f"context of {self.max_model_len}")
        if end > num_blocks * self.block_size:
            raise ValueError(f"request {request_id!r}: {num_blocks} blocks of "
                             f"{self.block_size} cannot hold {end} tokens")


def kernel_metadata(layout: list[ScheduledRequest], batch: InputBatch,
                    device: torch.device) -> list[AttentionMetadata]:
    """The kernel path's attention metadata of a step laid out as `layout`, every KV group's,
    from the batch's persistent block tables (worker_svc.attention.build_kernel_metadata)."""
    n = len(layout)
    rows = np.fromiter((s.state.row for s in layout), np.int64, n)
    query_lens = np.fromiter((s.num_new_tokens for s in layout), np.int64, n)
    context_lens = np.fromiter((s.num_computed_tokens for s in layout), np.int64, n)
    block_size = batch.block_size
    num_blocks = (context_lens + query_lens + block_size - 1) // block_size
    return build_kernel_metadata(query_lens, context_lens, batch.tables.gather(rows, num_blocks),
                                 block_size, device)
