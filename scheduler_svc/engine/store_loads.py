"""KV loads from the store, as the scheduler tracks them (issue 15, loading; issue 24,
layer-wise loads).

When kvcache_svc admits a request with `num_load_tokens` (tokens past its prefix hit that the
KV store holds for every rank), every rank fetches its slice of those tokens into the
request's fresh blocks and answers `KvLoaded`. The request stays in flight until every rank
has (one count of `num_in_flight` held here), so nothing schedules it meanwhile. A load that
came back short is a fallback, counted; the client never sees it. Two kinds:
- layer-wise (the admission's `num_new_tokens` > 0): the load's step also computes the rest of
  the prompt, its forward waiting for each layer's KV, and samples the first token. The
  request's `num_computed_tokens` moves past the load and the computed tokens at once; the
  ranks agree on what they loaded before sampling, so the step's output has a token for the
  request only when every rank got all of it. A short one samples nothing: `finish` moves the
  request back to what every rank loaded, to be computed on from there. The output and the
  reports may come in either order;
- in the background (`num_new_tokens` 0: pipeline stages, or only part of a hit fitted): the
  step computes nothing for the request while this and later steps run the others. Once every
  rank's report is in, `finish` moves its `num_computed_tokens` past what every rank loaded
  (the smallest count: a chunk one rank could not get is recomputed by all, from its first
  token), and the request is scheduled on from there as if it had computed them.
"""

import time
from dataclasses import dataclass, field

from scheduler_svc.engine.request import FinishReason, Request, RequestStatus
from services.kv_wire import AdmitResult
from services.wire import KvLoaded


@dataclass(frozen=True, slots=True)
class _Load:
    request: Request
    start: int              # num_computed_tokens before the load (the prefix hit)
    num_tokens: int         # tokens asked of each rank
    num_new: int            # tokens its step computes after them (0: a background load)
    first: bool             # the request's first admission (its cached tokens count it)

    @property
    def computed(self) -> int:
        """The request's num_computed_tokens while the load is in flight."""
        return self.start + (self.num_tokens + self.num_new if self.num_new else 0)


@dataclass(slots=True)
class _StepLoads:
    loads: list[_Load]
    since: float = field(default_factory=time.monotonic)   # when the step was sent
    reports: list[KvLoaded] = field(default_factory=list)  # one per rank, as they come


class StoreLoads:
    def __init__(self) -> None:
        self._by_step: dict[int, _StepLoads] = {}
        self.num_hit_tokens = 0         # admitted as loads (the store held them)
        self.num_miss_tokens = 0        # admitted prompt tokens in neither cache nor store
        self.num_loaded_tokens = 0      # loaded by every rank
        self.num_fallbacks = 0          # loads that came back short (the rest recomputed)

    def admitted(self, request: Request, num_cached: int, num_load: int) -> None:
        """Counts an admission's hits and misses (a first admission only: a request admitted
        again after preemption asks for its own tokens, not the prompt's)."""
        self.num_hit_tokens += num_load
        self.num_miss_tokens += max(0, request.num_prompt_tokens - num_cached - num_load)

    def add(self, step_id: int, loads: list[tuple[Request, AdmitResult, bool]]) -> None:
        """The loads of step `step_id`: (request, its admission, whether this is its first).
        A layer-wise load counts as the client's cached tokens at once: its first token,
        which may also be its last, comes only if every rank loaded it all."""
        if not loads:
            return
        self._by_step[step_id] = _StepLoads([
            _Load(r, a.num_cached_tokens, a.num_load_tokens, a.num_new_tokens, first)
            for r, a, first in loads])
        for request, admitted, first in loads:
            request.num_in_flight += 1      # until every rank reported (finish / forget)
            if admitted.num_new_tokens and first and request.num_cached_tokens is not None:
                request.num_cached_tokens += admitted.num_load_tokens
                request.num_store_loaded_tokens += admitted.num_load_tokens

    @property
    def steps(self) -> list[int]:
        """Steps whose loads some rank has not reported yet, oldest first."""
        return sorted(self._by_step)

    def report(self, report: KvLoaded) -> None:
        """One rank's report; a report of a step no longer waited for is dropped."""
        step = self._by_step.get(report.step_id)
        if step is not None:
            step.reports.append(report)

    def finish_reported(self, num_ranks: int, live: dict[str, Request]) -> None:
        """`finish` for every step all `num_ranks` ranks have reported."""
        for step_id in self.steps:
            reports = self._by_step[step_id].reports
            if len(reports) >= num_ranks:
                self.finish(step_id, reports, live)

    def overdue(self, timeout_s: float) -> int | None:
        """The oldest step still waiting for a report after `timeout_s`, if any."""
        now = time.monotonic()
        return next((s for s in self.steps if now - self._by_step[s].since > timeout_s), None)

    def finish(self, step_id: int, reports: list[KvLoaded],
               live: dict[str, Request]) -> None:
        """Applies every rank's report of step `step_id` to its requests still running."""
        step = self._by_step.pop(step_id, None)
        for load in step.loads if step is not None else []:
            request = load.request
            request.num_in_flight -= 1
            num_loaded = min((_loaded(report, request.request_id) for report in reports),
                             default=0)
            num_loaded = max(0, min(num_loaded, load.num_tokens))
            alive = (live.get(request.request_id) is request
                     and request.status is RequestStatus.RUNNING
                     and request.num_computed_tokens == load.computed)
            # A layer-wise load's request may have ended on the token its step sampled.
            if alive or (load.num_new and request.status is RequestStatus.FINISHED
                         and request.finish_reason is not FinishReason.ABORT):
                self.num_loaded_tokens += num_loaded
                self.num_fallbacks += num_loaded < load.num_tokens
            if not alive:
                continue      # aborted or finished while loading
            counted = num_loaded
            if load.num_new:        # layer-wise: counted at add, computed on already
                counted -= load.num_tokens
                if num_loaded < load.num_tokens:   # it sampled nothing: on from what loaded
                    request.num_computed_tokens = load.start + num_loaded
            else:
                request.num_computed_tokens += num_loaded
            if load.first and request.num_cached_tokens is not None:
                request.num_cached_tokens += counted    # what the client's usage reports
                request.num_store_loaded_tokens += counted

    def forget(self, step_id: int | None = None) -> None:
        """The step failed (its requests end), or (None) every request goes back to waiting:
        its loads count no more, and release their requests."""
        for each in [step_id] if step_id is not None else list(self._by_step):
            step = self._by_step.pop(each, None)
            for load in step.loads if step is not None else []:
                load.request.num_in_flight -= 1


def _loaded(report: KvLoaded, request_id: str) -> int:
    """What one rank loaded for a request; 0 when it does not name it."""
    for rid, num in zip(report.request_ids, report.num_loaded_tokens):
        if rid == request_id:
            return num
    return 0
