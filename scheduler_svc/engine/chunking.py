"""Chunked prefill as a policy: how many of a request's tokens one step may compute, given the
step's remaining token budget (vLLM's rules).

With chunked prefill on, a request takes what the budget leaves, capped per step by
`long_prefill_token_threshold` when set, so one long prompt cannot hold every step. Off, a
request runs whole or not at all this step. The scheduler asks for running requests
(`num_new_tokens`) and for admissions (`admit_tokens`); the KV pool's sizing asks for the
largest step one request can take (`max_step_tokens`).
"""

from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.request import Request


class Chunking:
    def __init__(self, config: SchedulerConfig) -> None:
        self.enabled = config.chunked_prefill
        # Per-step cap on one request's tokens (chunked prefill only; 0 = none).
        self.cap = config.long_prefill_token_threshold if config.chunked_prefill else 0
        self.token_budget = config.token_budget

    def num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens a running request computes this step (0: it waits for a later one)."""
        num_new = request.num_tokens + request.num_pending_tokens - request.num_computed_tokens
        if self.enabled:
            if self.cap > 0:
                num_new = min(num_new, self.cap)
            return min(num_new, budget)
        return num_new if num_new <= budget else 0

    def admit_tokens(self, num_tokens: int, budget: int) -> int | None:
        """The most tokens an admission of `num_tokens` may compute this step (its prefix hit
        comes off them at kvcache_svc); None when it cannot start this step (unchunked and
        over the budget)."""
        if not self.enabled and num_tokens > budget:
            return None
        max_new = min(budget, num_tokens)
        return min(max_new, self.cap) if self.cap > 0 else max_new

    def max_step_tokens(self) -> int:
        """The most tokens one request computes in one step."""
        return min(self.token_budget, self.cap) if self.cap > 0 else self.token_budget
