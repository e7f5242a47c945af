"""Phase 3 of a step, what comes back (scheduler_svc.engine.scheduler has the whole step): the
worker's sampled tokens appended to their requests (decode rows' included), token-level
endings checked (scheduler_svc.engine.stops), and the outputs for the front ends, as
`RequestOutput`s (`update`, the reference) or packed per front end (`update_packed`, what the
engine core runs); or, when the worker could not run the step, its requests ended with the
error (`fail_step`).

`StepResults` is the engine's `Scheduler`'s base: it works on the scheduler's state, which
the attributes below name.
"""

import itertools
from collections.abc import Iterator

from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.decode_rows import DecodeRowBook
from scheduler_svc.engine.fair_queue import FairQueue
from scheduler_svc.engine.outputs import StepPacker, finished_record
from scheduler_svc.engine.plan_book import PlanBook
from scheduler_svc.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from scheduler_svc.engine.steps_in_flight import StepsInFlight
from scheduler_svc.engine.stops import final_output, token_ending, token_output
from scheduler_svc.engine.store_loads import StoreLoads
from services.wire import StepError, StepOutput, TokenLogprobs


class StepResults:
    """A step's outputs taken into the scheduler's state, and requests' endings."""

    config: SchedulerConfig
    requests: dict[str, Request]
    running: list[Request]
    in_flight: StepsInFlight
    decode_rows: DecodeRowBook
    loads: StoreLoads
    ship_sampled_tokens: bool
    plans: PlanBook
    waiting: FairQueue
    _new_token_ids: dict[str, list[int]]
    _finished_ids: list[str]

    def _accepted(self, output: StepOutput) -> Iterator[tuple[Request, int, TokenLogprobs | None]]:
        """Every token of the step that a live request takes (its decode rows' included),
        appended to it; the request, the token and its logprobs."""
        sampling_ids = {e.request.request_id
                        for e in self.in_flight.leave(output.step_id) if e.samples}
        for chunk in output.prompt_logprobs:
            if (request := self.requests.get(chunk.request_id)) is not None:
                request.add_prompt_logprobs(chunk.first_position, chunk.logprobs, chunk.ranks)
        sampled = zip(output.request_ids, output.sampled_token_ids, output.logprobs,
                      strict=True)
        rows = ((r.request_id, t, None) for r, t in self.decode_rows.tokens(output))
        requests, running = self.requests, RequestStatus.RUNNING
        for request_id, token_id, logprobs in itertools.chain(sampled, rows):
            request = requests.get(request_id)
            if request is None or request.status is not running:
                continue  # aborted or preempted while the step ran: the token is dropped
            if request_id not in sampling_ids:
                continue  # a non-final prefill chunk (the worker should not sample those)
            request.append_token(token_id)
            if self.ship_sampled_tokens:
                self._new_token_ids.setdefault(request_id, []).append(token_id)
            yield request, token_id, logprobs

    def update(self, output: StepOutput) -> list[RequestOutput]:
        """The step's tokens taken; an output per request that took one."""
        outputs: list[RequestOutput] = []
        for request, token_id, logprobs in self._accepted(output):
            if self._ends(request, token_id):
                outputs.append(final_output(request, [token_id], [logprobs]))
            else:
                outputs.append(token_output(request, token_id, logprobs))
            if request.num_output_tokens == 1:
                outputs[-1].prompt_logprobs = request.prompt_logprobs_output()
        return outputs

    def update_packed(self, output: StepOutput, packer: StepPacker) -> None:
        """`update`, its outputs put straight into `packer` (scheduler_svc.engine.outputs):
        a row per token, a record only for an ending, logprobs or prompt logprobs. What the
        engine core runs every step; `update` is its reference (the same messages, the same
        state after: tests/scheduler_svc/engine/test_packed_path.py)."""
        for request, token_id, logprobs in self._accepted(output):
            out = packer.of(request.frontend)
            out.token(request.handle, token_id, logprobs)
            if request.num_output_tokens == 1 and request.sampling.prompt_logprobs is not None:
                out.prompt(request.handle, request.prompt_logprobs_output() or [])
            if self._ends(request, token_id):
                out.finished.append(finished_record(final_output(request, [], [])))

    def fail_step(self, step_id: int, error: StepError) -> tuple[list[RequestOutput], bool]:
        """The worker could not run step `step_id` and dropped that step's requests (it skips
        them in later steps already sent): each live one ends with `error` and gives its
        blocks back. Returns their final outputs, and whether the prefix index may now hold
        blocks whose KV was never written (the caller must then empty the index)."""
        entries, poisoned = self.in_flight.leave_failed(step_id, error.kv_written)
        poisoned = poisoned and self.config.prefix_caching
        self.loads.forget(step_id)
        self.decode_rows.forget(step_id)
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

    def _ends(self, request: Request, token_id: int) -> bool:
        """Whether `token_id`, just appended, ends `request` (stops.token_ending); if so it
        finishes here."""
        reason, stop_token = token_ending(request, token_id)
        if reason is None:
            return False
        self.running.remove(request)
        self._finish(request, reason, stop_token)
        return True

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
            self.plans.release(request, commit=reason is not FinishReason.ABORT)
        if request.on_worker:
            self._drop_on_worker(request)
        self._new_token_ids.pop(request.request_id, None)
        del self.requests[request.request_id]

    def _drop_on_worker(self, request: Request) -> None:
        """The workers drop its state with the next step (its slot is free after that)."""
        self._finished_ids.append(request.request_id)
        self.decode_rows.release(request)
