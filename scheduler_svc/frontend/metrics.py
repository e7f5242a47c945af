"""The request latency metrics a front end observes as each request's outputs stream out
(`RequestTimer`): time to first token, inter-token latency, end-to-end latency, and finished
request and token counters. Names follow vLLM's (`vllm:` prefix, same units and meaning).

Several front-end processes serve one scheduler: each records into prometheus_client's
multiprocess files (the cluster sets PROMETHEUS_MULTIPROC_DIR for them), and the cluster
process serves their sum at /metrics beside the cluster's own state (scheduler_svc.cluster.
metrics).
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

# Buckets as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RequestMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time to first token in seconds.", labels, registry=r,
                              buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive output tokens in seconds.", labels,
                             registry=r, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency in seconds.", labels, registry=r,
                             buckets=E2E_BUCKETS).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests, by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished "
                                     "requests.", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        self.failed = Counter("splitserve:request_failed", "Requests that ended with an error "
                              "(no replica by their deadline, ...).", labels,
                              registry=r).labels(model_name)

    def finished(self, reason: str, num_prompt_tokens: int) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)


class RequestTimer:
    """Per request: observes TTFT, inter-token latency and e2e latency as outputs arrive."""

    __slots__ = ("metrics", "arrival", "last_token")

    def __init__(self, metrics: RequestMetrics | None) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last_token: float | None = None

    def tokens(self, num_tokens: int) -> None:
        if self.metrics is None or num_tokens == 0:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last_token)
        self.last_token = now
        self.metrics.generation_tokens.inc(num_tokens)

    def finished(self, reason: str, num_prompt_tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
            self.metrics.finished(reason, num_prompt_tokens)

    def failed(self) -> None:
        if self.metrics is not None:
            self.metrics.failed.inc()
