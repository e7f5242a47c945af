"""A front end's request metrics (scheduler_svc.frontend.metrics) as the step messages of an
engine core reach its live requests (scheduler_svc.frontend.requests): vLLM's names, the
`model_name` and `engine` labels, time to first token taken when the first token arrives
(also for a client that takes the whole output at the end), the engine core's phases from
its finish record."""

import pytest
from prometheus_client import CollectorRegistry

from scheduler_svc.engine.request import FinishReason
from scheduler_svc.engine.wire import Timing
from scheduler_svc.frontend.metrics import RequestMetrics, RequestTimer, buckets_1_2_5
from scheduler_svc.frontend.requests import FrontRequest, LiveRequests
from scheduler_svc.frontend.streams import OutputStream
from scheduler_svc.frontend.tokenizer import TextTokenizer
from tests.scheduler_svc.frontend.fakes import finished, front_request, step_message

MODEL = "tiny"
VOCAB = 49152
A, B = (3, 100), (5, 100)      # (replica id, engine epoch)
PHASES = Timing(queued_s=0.25, prefill_s=0.5, decode_s=2.0, inference_s=2.5)


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    c = ManualClock()
    monkeypatch.setattr("scheduler_svc.frontend.metrics.clock", c)
    return c


@pytest.fixture
def metrics() -> RequestMetrics:
    return RequestMetrics(MODEL, CollectorRegistry(), max_model_len=1024)


def value(m: RequestMetrics, name: str, engine: str, **labels: str) -> float:
    got = m.registry.get_sample_value(name, {"model_name": MODEL, "engine": engine, **labels})
    return 0.0 if got is None else got


def live_request(tokenizer: TextTokenizer, m: RequestMetrics, stream: OutputStream,
                 max_tokens: int = 3) -> tuple[LiveRequests, FrontRequest]:
    live = LiveRequests()
    r = front_request(tokenizer, "r", [5, 6, 7, 8], handle=live.new_handle(),
                      max_tokens=max_tokens)
    r.timer, r.stream = RequestTimer(m), stream
    live.add(r)
    live.place(r, A)
    return live, r


def test_whole_output_ttft_is_when_its_first_token_arrived(
        tokenizer: TextTokenizer, metrics: RequestMetrics, clock: ManualClock) -> None:
    stream = OutputStream(None)             # a client that takes the whole output at the end
    live, r = live_request(tokenizer, metrics, stream)
    clock.now += 1.0
    live.take_outputs(step_message(A, [(r.handle, 100)]), A, VOCAB)
    clock.now += 0.5
    live.take_outputs(step_message(A, [(r.handle, 101)]), A, VOCAB)
    clock.now += 2.0
    assert not stream._waiting               # its client has been handed nothing yet
    live.take_outputs(step_message(A, [(r.handle, 102)], [finished(
        r.handle, "length", 4, 3)]), A, VOCAB)
    assert len(stream._waiting) == 1         # all of it, at the end
    e = "3"
    assert value(metrics, "vllm:time_to_first_token_seconds_sum", e) == 1.0
    assert value(metrics, "vllm:time_to_first_token_seconds_count", e) == 1
    assert value(metrics, "vllm:e2e_request_latency_seconds_sum", e) == 3.5
    assert value(metrics, "vllm:inter_token_latency_seconds_count", e) == 2
    assert value(metrics, "vllm:inter_token_latency_seconds_sum", e) == 2.5
    assert value(metrics, "vllm:time_per_output_token_seconds_sum", e) == 2.5
    assert value(metrics, "vllm:request_time_per_output_token_seconds_sum", e) == 1.25
    assert value(metrics, "vllm:request_success_total", e, finished_reason="length") == 1
    assert value(metrics, "vllm:generation_tokens_total", e) == 3
    assert value(metrics, "vllm:prompt_tokens_total", e) == 4
    assert value(metrics, "vllm:request_prompt_tokens_sum", e) == 4
    assert value(metrics, "vllm:request_generation_tokens_sum", e) == 3
    assert value(metrics, "vllm:request_max_num_generation_tokens_sum", e) == 3
    assert value(metrics, "vllm:request_params_max_tokens_sum", e) == 3
    assert value(metrics, "vllm:request_generation_tokens_bucket", e, le="2.0") == 0
    assert value(metrics, "vllm:request_generation_tokens_bucket", e, le="5.0") == 1
    # No finish record timing: no phases.
    assert value(metrics, "vllm:request_queue_time_seconds_count", e) == 0


def test_phases_come_from_the_finish_record(tokenizer: TextTokenizer, metrics: RequestMetrics,
                                            clock: ManualClock) -> None:
    live, r = live_request(tokenizer, metrics, OutputStream(1), max_tokens=1)
    fin = finished(r.handle, "length", 4, 1)
    fin.timing = PHASES
    live.take_outputs(step_message(A, [(r.handle, 100)], [fin]), A, VOCAB)
    for name, seconds in (("queue", 0.25), ("prefill", 0.5), ("decode", 2.0),
                          ("inference", 2.5)):
        assert value(metrics, f"vllm:request_{name}_time_seconds_sum", "3") == seconds, name
        assert value(metrics, f"vllm:request_{name}_time_seconds_count", "3") == 1, name


def test_engine_label_follows_the_replica(tokenizer: TextTokenizer, metrics: RequestMetrics,
                                          clock: ManualClock) -> None:
    live, r = live_request(tokenizer, metrics, OutputStream(1), max_tokens=2)
    live.take_outputs(step_message(A, [(r.handle, 100)]), A, VOCAB)
    live.place(r, B)                                     # moved off a lost replica
    clock.now += 1.0
    live.take_outputs(step_message(A, [(r.handle, 999)]), A, VOCAB)   # stale: ignored
    live.take_outputs(step_message(B, [(r.handle, 101)], [finished(r.handle, "length", 4, 2)]),
                      B, VOCAB)
    assert value(metrics, "vllm:time_to_first_token_seconds_count", "3") == 1
    assert value(metrics, "vllm:time_to_first_token_seconds_count", "5") == 0
    assert value(metrics, "vllm:inter_token_latency_seconds_count", "5") == 1
    assert value(metrics, "vllm:generation_tokens_total", "3") == 1
    assert value(metrics, "vllm:generation_tokens_total", "5") == 1
    assert value(metrics, "vllm:request_success_total", "5", finished_reason="length") == 1
    assert value(metrics, "vllm:request_success_total", "3", finished_reason="length") == 0


def test_a_request_cancelled_before_any_replica_counts_under_no_engine(
        tokenizer: TextTokenizer, metrics: RequestMetrics, clock: ManualClock) -> None:
    r = front_request(tokenizer, "p", [5, 6])
    r.timer = RequestTimer(metrics)
    clock.now += 2.0
    r.finish(FinishReason.ABORT, None, None)
    assert value(metrics, "vllm:request_success_total", "none", finished_reason="abort") == 1
    assert value(metrics, "vllm:e2e_request_latency_seconds_sum", "none") == 2.0
    assert value(metrics, "vllm:time_to_first_token_seconds_count", "none") == 0


def test_a_failed_request_is_not_a_success(tokenizer: TextTokenizer,
                                           metrics: RequestMetrics) -> None:
    live, r = live_request(tokenizer, metrics, OutputStream(1))
    live.take_outputs(step_message(A, [], [finished(r.handle, "abort", 4, 0,
                                                    error="the worker failed")]), A, VOCAB)
    assert metrics.registry.get_sample_value("splitserve:request_failed_total",
                                             {"model_name": MODEL}) == 1
    assert value(metrics, "vllm:request_success_total", "3", finished_reason="abort") == 0


def test_length_buckets_are_1_2_5_up_to_the_context() -> None:
    assert buckets_1_2_5(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert buckets_1_2_5(5) == (1, 2, 5)
    m = RequestMetrics(MODEL, CollectorRegistry(), max_model_len=100)
    m.engine(0).prompt_len.observe(150)
    assert m.registry.get_sample_value("vllm:request_prompt_tokens_bucket", {
        "model_name": MODEL, "engine": "0", "le": "100.0"}) == 0
    assert m.registry.get_sample_value("vllm:request_prompt_tokens_bucket", {
        "model_name": MODEL, "engine": "0", "le": "+Inf"}) == 1


def test_observing_many_at_once_equals_one_by_one() -> None:
    """observe_many reaches into prometheus_client's Histogram: the same samples as its own
    observe, bucket edges included (a value equal to a bound falls in that bound's bucket)."""
    from prometheus_client import Histogram

    from scheduler_svc.frontend.metrics import ITL_BUCKETS, observe_many

    values = [0.0, 0.01, 0.0100001, 0.3, 0.3, 2.5, 79.9, 80.0, 1e6, 0.02]
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("x", "x", buckets=ITL_BUCKETS, registry=one)
    h2 = Histogram("x", "x", buckets=ITL_BUCKETS, registry=many)
    for v in values:
        h1.observe(v)
    observe_many(h2, values)
    observe_many(h2, [])
    def samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for family in registry.collect()
                for s in family.samples if not s.name.endswith("_created")]

    assert samples(one) == samples(many) and len(samples(one)) == len(ITL_BUCKETS) + 3


def test_a_steps_gaps_are_written_at_flush(metrics: RequestMetrics, clock: ManualClock) -> None:
    timers = [RequestTimer(metrics) for _ in range(3)]
    for t in timers:
        t.tokens(1, 3)                       # first tokens: TTFT at once, no gap
    metrics.flush()
    clock.now += 0.5
    for t in timers:
        t.tokens(1, 3)
    assert value(metrics, "vllm:inter_token_latency_seconds_count", "3") == 0
    assert value(metrics, "vllm:generation_tokens_total", "3") == 3
    metrics.flush()
    assert value(metrics, "vllm:inter_token_latency_seconds_count", "3") == 3
    assert value(metrics, "vllm:inter_token_latency_seconds_sum", "3") == 1.5
    assert value(metrics, "vllm:time_per_output_token_seconds_count", "3") == 3
    assert value(metrics, "vllm:generation_tokens_total", "3") == 6
    metrics.flush()                          # nothing new: nothing written twice
    assert value(metrics, "vllm:generation_tokens_total", "3") == 6
