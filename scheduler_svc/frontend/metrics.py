"""The request metrics a front end observes (`RequestMetrics`, one per front-end process, and
a `RequestTimer` per request): time to first token, inter-token latency, end-to-end latency,
the engine core's phases of each request (queue, prefill, decode, inference), prompt and
generation lengths, finished requests by reason, token counters.

Names, units, buckets and labels are vLLM's (`vllm:` prefix; labels `model_name` and
`engine`, the replica that ran the request), so a dashboard built for vLLM reads them
unchanged (tests/e2e/test_metrics_dashboard.py renders vLLM's reference dashboard's queries
against a scrape).

When: tokens are timed as each engine step's message reaches the front end
(`FrontRequest.take`), not when the client is handed them, so a client that takes the whole
output at the end still gets its request's real time to first token. A step's inter-token
gaps and token counts are gathered per replica and written once per step message (`flush`):
an observation in multiprocess mode costs a few microseconds, which per token would be most
of the front end's work on a whole reply. The phases come from
the engine core's finish record (`Finished.timing`): only the engine core knows when the
request was scheduled and when its tokens were made.

Several front-end processes serve one scheduler: each records into prometheus_client's
multiprocess files (the cluster sets PROMETHEUS_MULTIPROC_DIR for them), and the cluster
process serves their sum at /metrics beside the cluster's own state (scheduler_svc.cluster.
metrics).
"""

import bisect
import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Histogram

from scheduler_svc.engine.wire import Timing

# Buckets as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
clock = time.monotonic  # what requests are timed by; a test may run it by hand
NO_ENGINE = "none"      # the `engine` of a request that ended before it reached a replica
LABELS = ("model_name", "engine")


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for every value, in one write per bucket touched and one for
    the sum. It reaches into prometheus_client's Histogram (its `_upper_bounds`, `_buckets`,
    `_sum`, as its own `observe` does; pinned version): tests/scheduler_svc/frontend/
    test_metrics.py checks the result equals observing the values one by one."""
    if not values:
        return
    bounds = histogram._upper_bounds     # ascending, the last +Inf: every value has a bucket
    histogram._sum.inc(sum(values))
    for index, count in Tally(bisect.bisect_left(bounds, v) for v in values).items():
        histogram._buckets[index].inc(count)


def buckets_1_2_5(largest: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's length buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


class EngineSeries:
    """One engine's children of every family (a label lookup once per engine, not per
    observation)."""

    __slots__ = ("label", "ttft", "itl", "tpot", "e2e", "request_tpot", "queue", "prefill",
                 "decode", "inference", "prompt_len", "generation_len", "max_generation_len",
                 "max_tokens", "prompt_tokens", "generation_tokens")

    def __init__(self, m: "RequestMetrics", label: str) -> None:
        values = (m.model_name, label)
        self.label = label
        self.ttft = m._ttft.labels(*values)
        self.itl = m._itl.labels(*values)
        self.tpot = m._tpot.labels(*values)
        self.e2e = m._e2e.labels(*values)
        self.request_tpot = m._request_tpot.labels(*values)
        self.queue = m._queue.labels(*values)
        self.prefill = m._prefill.labels(*values)
        self.decode = m._decode.labels(*values)
        self.inference = m._inference.labels(*values)
        self.prompt_len = m._prompt_len.labels(*values)
        self.generation_len = m._generation_len.labels(*values)
        self.max_generation_len = m._max_generation_len.labels(*values)
        self.max_tokens = m._max_tokens.labels(*values)
        self.prompt_tokens = m._prompt_tokens.labels(*values)
        self.generation_tokens = m._generation_tokens.labels(*values)


class RequestMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 max_model_len: int = 1 << 20) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.model_name = model_name
        lengths = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=r, buckets=buckets)

        self._ttft = histogram("vllm:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self._itl = histogram("vllm:inter_token_latency_seconds",
                              "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        # vLLM's older name of the same observation, which its reference dashboard reads.
        self._tpot = histogram("vllm:time_per_output_token_seconds",
                               "Histogram of time per output token in seconds.", ITL_BUCKETS)
        self._e2e = histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self._request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self._queue = histogram("vllm:request_queue_time_seconds",
                                "Histogram of time spent in WAITING phase for request.",
                                E2E_BUCKETS)
        self._prefill = histogram("vllm:request_prefill_time_seconds",
                                  "Histogram of time spent in PREFILL phase for request.",
                                  E2E_BUCKETS)
        self._decode = histogram("vllm:request_decode_time_seconds",
                                 "Histogram of time spent in DECODE phase for request.",
                                 E2E_BUCKETS)
        self._inference = histogram("vllm:request_inference_time_seconds",
                                    "Histogram of time spent in RUNNING phase for request.",
                                    E2E_BUCKETS)
        self._prompt_len = histogram("vllm:request_prompt_tokens",
                                     "Number of prefill tokens processed.", lengths)
        self._generation_len = histogram("vllm:request_generation_tokens",
                                         "Number of generation tokens processed.", lengths)
        self._max_generation_len = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", lengths)
        self._max_tokens = histogram("vllm:request_params_max_tokens",
                                     "Histogram of the max_tokens request parameter.", lengths)
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens "
                                      "processed.", LABELS, registry=r)
        self._generation_tokens = Counter("vllm:generation_tokens", "Number of generation "
                                          "tokens processed.", LABELS, registry=r)
        self._success = Counter("vllm:request_success", "Count of successfully processed "
                                "requests.", [*LABELS, "finished_reason"], registry=r)
        self.failed = Counter("splitserve:request_failed", "Requests that ended with an error "
                              "(no replica by their deadline, ...).", ["model_name"],
                              registry=r).labels(model_name)
        self._engines: dict[int | None, EngineSeries] = {}
        # What this step message brought, per replica, until `flush`: inter-token gaps and
        # tokens made.
        self._gaps: dict[int, list[float]] = {}
        self._num_tokens: dict[int, int] = {}

    def note_tokens(self, replica_id: int, num_tokens: int, gap: float | None) -> None:
        """`num_tokens` made by one step of `replica_id` for one request, `gap` seconds after
        its previous ones (None: its first); written at the next `flush`."""
        if gap is not None:
            self._gaps.setdefault(replica_id, []).append(gap)
        self._num_tokens[replica_id] = self._num_tokens.get(replica_id, 0) + num_tokens

    def flush(self) -> None:
        """Writes what `note_tokens` gathered: once per step message, and before an end."""
        for replica_id, gaps in self._gaps.items():
            s = self.engine(replica_id)
            observe_many(s.itl, gaps)
            observe_many(s.tpot, gaps)
        for replica_id, num_tokens in self._num_tokens.items():
            self.engine(replica_id).generation_tokens.inc(num_tokens)
        self._gaps.clear()
        self._num_tokens.clear()

    def engine(self, replica_id: int | None) -> EngineSeries:
        """The series of one replica (None: of no replica)."""
        series = self._engines.get(replica_id)
        if series is None:
            label = NO_ENGINE if replica_id is None else str(replica_id)
            series = self._engines[replica_id] = EngineSeries(self, label)
        return series

    def finished(self, replica_id: int | None, reason: str, num_prompt_tokens: int,
                 num_output_tokens: int, max_tokens: int, e2e_s: float,
                 decode_s: float | None, timing: Timing | None) -> None:
        """A request ended (`reason`: stop, length or abort). `decode_s`: first token to
        last as the front end saw them (None: no token); `timing`: the engine core's phases
        (None: it was never scheduled, or ended on the front end)."""
        s = self.engine(replica_id)
        self._success.labels(self.model_name, s.label, reason).inc()
        s.e2e.observe(e2e_s)
        s.prompt_tokens.inc(num_prompt_tokens)
        s.prompt_len.observe(num_prompt_tokens)
        s.generation_len.observe(num_output_tokens)
        # Each choice of a request runs (and ends) as a request of its own here: its own
        # generation length is its group's maximum.
        s.max_generation_len.observe(num_output_tokens)
        s.max_tokens.observe(max_tokens)
        if decode_s is not None and num_output_tokens > 1:
            s.request_tpot.observe(decode_s / (num_output_tokens - 1))
        if timing is not None:
            s.queue.observe(timing.queued_s)
            s.prefill.observe(timing.prefill_s)
            s.decode.observe(timing.decode_s)
            s.inference.observe(timing.inference_s)


class RequestTimer:
    """Per request: observes TTFT and inter-token latency as its tokens arrive from its
    engine core, and the rest when it ends."""

    __slots__ = ("metrics", "arrival", "first_token", "last_token", "replica_id")

    def __init__(self, metrics: RequestMetrics | None) -> None:
        self.metrics = metrics
        self.arrival = clock()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.replica_id: int | None = None     # the replica its last tokens came from

    def tokens(self, num_tokens: int, replica_id: int) -> None:
        """`num_tokens` (> 0) made by one step of replica `replica_id`, just arrived."""
        self.replica_id = replica_id
        if self.metrics is None:
            return
        now = clock()
        gap = None
        if self.last_token is None:
            self.first_token = now
            self.metrics.engine(replica_id).ttft.observe(now - self.arrival)
        else:
            gap = now - self.last_token
        self.last_token = now
        self.metrics.note_tokens(replica_id, num_tokens, gap)

    def finished(self, reason: str, num_prompt_tokens: int, num_output_tokens: int,
                 max_tokens: int, timing: Timing | None,
                 replica_id: int | None = None) -> None:
        """It ended: on `replica_id` (None: where its last tokens came from)."""
        if self.metrics is None:
            return
        self.metrics.flush()
        now = clock()
        decode_s = None
        if self.first_token is not None and self.last_token is not None:
            decode_s = self.last_token - self.first_token
        self.metrics.finished(self.replica_id if replica_id is None else replica_id, reason,
                              num_prompt_tokens, num_output_tokens, max_tokens,
                              now - self.arrival, decode_s, timing)

    def failed(self) -> None:
        if self.metrics is not None:
            self.metrics.failed.inc()
