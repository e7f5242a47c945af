"""The steps a replica has sent and not yet heard back from, and what each holds of its
requests: whether it samples a token for them, and whether its plan put their block hashes in
the prefix index before their KV was computed.

The PP batch queue and async scheduling keep several steps in flight. The scheduler enters a
step when it builds its `StepInput` and leaves it when the step's output or failure comes back
(or when kvcache_svc's loss preempts everything); a request's `num_in_flight` and
`num_pending_tokens` count the steps it is in and the tokens they will sample for it.
"""

from dataclasses import dataclass

from scheduler_svc.engine.request import Request


@dataclass(frozen=True, slots=True)
class InStep:
    """One request's share of a step in flight."""
    request: Request
    samples: bool        # the step samples a token for it (not a non-final prefill chunk)
    commits: bool        # its plan put block hashes in the prefix index (their KV is this step's)


class StepsInFlight:
    def __init__(self) -> None:
        self._steps: dict[int, list[InStep]] = {}    # step id -> its requests

    def enter(self, step_id: int, requests: list[Request], committing: set[str]) -> list[InStep]:
        """Records step `step_id` with `requests`; `committing`: the ids whose plan committed
        blocks. A step samples for a request when it reaches the end of its known tokens (a
        non-final prefill chunk does not)."""
        entries = []
        for request in requests:
            samples = (request.num_computed_tokens
                       == request.num_tokens + request.num_pending_tokens)
            request.num_in_flight += 1
            request.num_pending_tokens += samples
            entries.append(InStep(request, samples, request.request_id in committing))
        self._steps[step_id] = entries
        return entries

    def leave(self, step_id: int) -> list[InStep]:
        """The step's entries, its share of each request's counters given back; [] for a step
        already left (or never entered)."""
        entries = self._steps.pop(step_id, [])
        for e in entries:
            e.request.num_in_flight -= 1
            e.request.num_pending_tokens -= e.samples
        return entries

    def leave_all(self) -> None:
        for step_id in list(self._steps):
            self.leave(step_id)

    def leave_failed(self, step_id: int, kv_written: bool) -> tuple[list[InStep], bool]:
        """`leave` for a step the worker failed, and whether the prefix index may now name
        blocks whose KV was never written. Blocks are committed when planned, before their KV
        is computed. Bad: this step's commits if it failed before its forward finished
        (`kv_written` False), and any commit for one of its requests by a later step in
        flight, which the worker skips (none today: such a step only decodes it, with a token
        unknown when planned). Finished or aborted requests count too: their freed blocks keep
        their hashes."""
        entries = self.leave(step_id)
        failed = {e.request for e in entries}
        poisoned = (not kv_written and any(e.commits for e in entries)) or any(
            e.commits and e.request in failed
            for later in self._steps.values() for e in later)
        return entries, poisoned
