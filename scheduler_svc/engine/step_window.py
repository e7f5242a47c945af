"""Where a replica's step time goes: the engine records each step's phases (`StepTimes`),
which sums them over a window and logs one line per window (`STEP_LOG_INTERVAL` steps), and
keeps the last stage's idle time between forwards since start (ServerInfo)."""

import logging
from dataclasses import dataclass

from services.wire import StepTimings

log = logging.getLogger(__name__)

STEP_LOG_INTERVAL = 200  # steps between timing summaries in the log


@dataclass(slots=True)
class StepWindow:
    """Where a replica's step time went, summed over a window of steps (milliseconds)."""

    num_steps: int = 0
    num_tokens: int = 0
    plan_ms: float = 0.0      # schedule + kvcache plan call + building the StepInput
    step_ms: float = 0.0      # StepInput sent -> StepOutput received
    update_ms: float = 0.0    # appending tokens, stop checks, detokenizing, publishing
    forward_ms: float = 0.0   # the worker's own forward + sampling time
    gap_ms: float = 0.0       # the last stage's idle time between forwards (see StepTimings)
    num_gaps: int = 0

    def add(self, plan_ms: float, step_ms: float, update_ms: float, forward_ms: float,
            num_tokens: int, gap_ms: float = 0.0) -> None:
        if gap_ms > 0:
            self.gap_ms += gap_ms
            self.num_gaps += 1
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.plan_ms += plan_ms
        self.step_ms += step_ms
        self.update_ms += update_ms
        self.forward_ms += forward_ms

    def summary(self) -> str:
        n = max(1, self.num_steps)
        return (f"{self.num_steps} steps ({self.num_tokens} tokens), per step: plan "
                f"{self.plan_ms / n:.2f} ms, worker round trip {self.step_ms / n:.1f} ms "
                f"(forward+sample {self.forward_ms / n:.1f} ms), update "
                f"{self.update_ms / n:.2f} ms, gap between forwards "
                f"{self.gap_ms / max(1, self.num_gaps):.2f} ms")


class StepTimes:
    """One replica's step timings, recorded by its engine thread."""

    def __init__(self, replica_id: int) -> None:
        self.replica_id = replica_id
        self.window = StepWindow()
        self.gap_ms_total = 0.0       # sum of StepTimings.gap_ms since start (ServerInfo)
        self.num_gaps = 0

    def record(self, started: float, sent: float, received: float, updated: float,
               timings: StepTimings) -> None:
        """A step's phases (perf_counter seconds: planning began, StepInput sent, StepOutput
        received, outputs published) and the worker's own timings."""
        if timings.gap_ms > 0:
            self.gap_ms_total += timings.gap_ms
            self.num_gaps += 1
        self.window.add(plan_ms=(sent - started) * 1000, step_ms=(received - sent) * 1000,
                        update_ms=(updated - received) * 1000,
                        forward_ms=timings.forward_ms + timings.sample_ms,
                        num_tokens=timings.num_tokens, gap_ms=timings.gap_ms)
        if self.window.num_steps == STEP_LOG_INTERVAL:
            log.info("replica %d, last %s", self.replica_id, self.window.summary())
            self.window = StepWindow()
