"""KV loads from the store, as the scheduler tracks them (issue 15, loading).

When kvcache_svc admits a request with `num_load_tokens` (tokens past its prefix hit that the
KV store holds for every rank), the request's step computes nothing for it: every rank fetches
its slice of those tokens into the request's fresh blocks in the background, and answers
`KvLoaded` when done, while this and later steps run the other requests (their outputs do not
wait for the load). The request stays in flight meanwhile (one count of `num_in_flight` held
here), so nothing schedules it. Once every rank's `KvLoaded` is in, `StoreLoads.finish` moves
its `num_computed_tokens` past what every rank loaded (the smallest count: a chunk one rank
could not get is recomputed by all, from its first token), and the request is scheduled on
from there as if it had computed them. A load that came back short is a fallback, counted; the
client never sees it.
"""

import time
from dataclasses import dataclass, field

from scheduler_svc.request import Request, RequestStatus
from services.wire import KvLoaded


@dataclass(frozen=True, slots=True)
class _Load:
    request: Request
    start: int              # num_computed_tokens before the load (the prefix hit)
    num_tokens: int         # tokens asked of each rank
    first: bool             # the request's first admission (its cached tokens count it)


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

    def add(self, step_id: int, loads: list[tuple[Request, int, bool]]) -> None:
        """The loads of step `step_id`: (request, tokens to load after its computed ones,
        whether this is its first admission)."""
        if loads:
            self._by_step[step_id] = _StepLoads([_Load(r, r.num_computed_tokens, n, first)
                                                 for r, n, first in loads])
            for request, _, _ in loads:
                request.num_in_flight += 1      # until every rank reported (finish / forget)

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
            if (live.get(request.request_id) is not request
                    or request.status is not RequestStatus.RUNNING
                    or request.num_computed_tokens != load.start):
                continue      # aborted or finished while loading
            num_loaded = min((_loaded(report, request.request_id) for report in reports),
                             default=0)
            num_loaded = max(0, min(num_loaded, load.num_tokens))
            request.num_computed_tokens += num_loaded
            if load.first and request.num_cached_tokens is not None:
                request.num_cached_tokens += num_loaded   # what the client's usage reports
                request.num_store_loaded_tokens += num_loaded
            self.num_loaded_tokens += num_loaded
            self.num_fallbacks += num_loaded < load.num_tokens

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
