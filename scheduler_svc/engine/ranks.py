"""The engine loop's waits on its replica's worker ranks (scheduler_svc.engine.core): their
KV caches allocated, each step's output, and the KV load reports every rank sends.

Every wait polls in short slices, checking between them whether the replica was told to go
down, and gives up at the step timeout. A rank that fails, or a wait that times out, raises
`EngineError` (the replica goes down); a rank that failed a step by itself, not through a lost
peer, raises `StepFailedOnRank`, so the engine fails that step's requests first.
"""

import logging
import time
from collections.abc import Callable

from scheduler_svc.engine.store_loads import StoreLoads
from scheduler_svc.engine.transport import EngineTransport
from services.wire import CacheReady, InitCache, KvLoaded, StepOutput, WorkerFailure

log = logging.getLogger(__name__)

POLL_S = 0.2              # how often blocking waits look for a fail-over


class EngineError(RuntimeError):
    """The replica cannot go on (the message says why): it goes down."""


class StepFailedOnRank(EngineError):
    """A rank failed the step it was waited for, by itself (not a lost peer): the step's own
    requests end with this error before the replica goes down. Handed back instead, a request
    that makes every step fail would take each replica it lands on down in turn."""


class Ranks:
    """One replica's worker ranks, over the engine's transport."""

    def __init__(self, io: EngineTransport, loads: StoreLoads, step_timeout_s: float,
                 check_down: Callable[[], None]) -> None:
        """`loads`: the scheduler's, given every KvLoaded that arrives. `check_down` raises
        EngineError once the replica was told to go down."""
        self.io = io
        self.loads = loads
        self.step_timeout_s = step_timeout_s
        self.check_down = check_down

    def init_caches(self, num_blocks: int, block_size: int) -> None:
        """Every rank allocates its KV cache."""
        io = self.io
        io.send_to_ranks(InitCache(num_blocks=num_blocks, block_size=block_size))
        ready = 0
        deadline = time.monotonic() + self.step_timeout_s
        while ready < io.num_ranks:
            self.check_down()
            msg = io.recv_from_ranks(timeout_ms=int(POLL_S * 1000))
            if msg is None:
                if time.monotonic() > deadline:
                    raise EngineError("workers did not allocate their KV cache in time")
                continue
            if isinstance(msg, WorkerFailure):
                raise EngineError(f"worker {msg.worker_id} failed: {msg.message}")
            if isinstance(msg, CacheReady):
                ready += 1

    def wait_output(self, step_id: int) -> StepOutput:
        """The step's output; every rank's KvLoaded that comes meanwhile goes to the loads
        (for this step or another)."""
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            self.check_down()
            msg = self.io.recv_from_ranks(timeout_ms=int(POLL_S * 1000))
            if msg is None:
                if time.monotonic() > deadline:
                    raise EngineError(f"no output for step {step_id} within "
                                      f"{self.step_timeout_s:.0f}s")
                continue
            if isinstance(msg, WorkerFailure):
                reason = f"worker {msg.worker_id} failed step {msg.step_id}: {msg.message}"
                if msg.step_id == step_id and not msg.peer_lost:
                    raise StepFailedOnRank(reason)
                raise EngineError(reason)     # all move on when the replica goes down
            if isinstance(msg, StepOutput) and msg.step_id == step_id:
                return msg
            self._other(msg)

    def poll_loads(self, timeout_ms: int = 5) -> None:
        """Nothing in flight but loads: the ranks' messages for `timeout_ms`."""
        msg = self.io.recv_from_ranks(timeout_ms=timeout_ms)
        if isinstance(msg, WorkerFailure):
            raise EngineError(f"worker {msg.worker_id} failed step {msg.step_id}: {msg.message}")
        if msg is not None:
            self._other(msg)

    def _other(self, msg: object) -> None:
        if isinstance(msg, KvLoaded):
            self.loads.report(msg)
        else:
            log.warning("ignoring stale worker message %s", type(msg).__name__)
