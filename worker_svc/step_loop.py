"""The worker's step loop for one placement: receive InitCache and StepInput messages in
order, launch each step on this stage (worker_svc.stage_step), and send outputs, KV load
reports and failures back to the scheduler in step order.

`WorkerServer` (worker_svc.server) builds one `StepLoop` per registration, once its runner is
placed and its capacity reported, and runs it until the process stops or the scheduler
forgets this incarnation. InitCache is handed to the placement's owner (worker_svc.placement).

Only the last pipeline stage's tp_rank 0 answers steps. A step that raises on a one-rank
replica is answered with a StepOutput carrying the error: the runner dropped the step's
requests and nothing else changed, so the scheduler fails just those. On a replica of more
ranks the peers may be stuck in a collective (or hold state this rank no longer has), so the
answer is `WorkerFailure` and the scheduler takes the replica down. Either way the loop goes
on.
"""

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from services.channels import Receiver, Sender
from services.rpc.splitserve.v1 import control_pb2
from services.wire import InitCache, StepInput, ToWorker, WorkerFailure
from worker_svc.launched_step import LaunchedStep
from worker_svc.load_ticket import LoadTicket
from worker_svc.parallel import ParallelGroups, PeerLost
from worker_svc.shard_runner import ShardRunner
from worker_svc.stage_step import launch_stage

log = logging.getLogger(__name__)


class StepLoop:
    """Serves one placement's messages with its runner; outputs leave in step order."""

    def __init__(self, runner: ShardRunner, outputs: Sender,
                 placement: control_pb2.RegisterResponse, link: ParallelGroups | None,
                 worker_id: str, overlap: bool, init_cache: Callable[[InitCache], None]
                 ) -> None:
        """`overlap`: read a step's output only after the next step is launched (CUDA or the
        null model's emulated device, one pipeline stage). `init_cache`: answers an InitCache
        (allocates or refuses)."""
        self.runner = runner
        self.outputs = outputs
        self.placement = placement
        self.link = link
        self.worker_id = worker_id
        self.overlap = overlap
        self.init_cache = init_cache

    def run(self, steps: Receiver[ToWorker], stop: threading.Event,
            lost: threading.Event) -> None:
        """Until `stop` or `lost` is set. With overlap, a step's output is read only after
        the next step is launched or the GPU is done with it, whichever comes first: the GPU
        then has the next step queued while the host waits, copies and sends (see
        worker_svc.runner)."""
        pending: LaunchedStep | None = None
        loads: deque[LoadTicket] = deque()   # steps' KV loads, reported once done, in order
        while not stop.is_set() and not lost.is_set():
            while loads and loads[0].done:
                self.outputs.send(loads.popleft().report(self.worker_id))
            message = steps.recv(timeout_ms=0 if pending is not None else 2 if loads else 200)
            if message is None:
                if pending is not None:
                    if pending.ready():
                        self._finish_step(pending)
                        pending = None
                    else:
                        time.sleep(20e-6)
                continue
            if pending is not None and not isinstance(message, StepInput):
                self._finish_step(pending)
                pending = None
            if isinstance(message, InitCache):
                self.init_cache(message)
            elif isinstance(message, StepInput):
                try:
                    launched = launch_stage(self.runner, message, self.link)
                except Exception as exc:
                    if pending is not None:
                        self._finish_step(pending)
                        pending = None
                    self._send_failure(message, exc)
                    continue
                if pending is not None:
                    self._finish_step(pending)
                    pending = None
                if launched.loads is not None:
                    loads.append(launched.loads)
                if self.link is not None and self.link.next_rank is not None:
                    continue                      # forwarded: this stage is done with it
                if self.overlap:
                    pending = launched
                else:
                    self._finish_step(launched)
        if pending is not None:
            self._finish_step(pending)
        log.info("worker %s %s", self.worker_id,
                 "stopping" if stop.is_set() else "leaving its replica")

    def _send_failure(self, step: StepInput, exc: Exception) -> None:
        log.error("step %d failed", step.step_id, exc_info=exc)
        if self.link is None:
            self.outputs.send(self.runner.failed_output(step, exc))
        else:
            self.outputs.send(WorkerFailure(worker_id=self.worker_id, step_id=step.step_id,
                                            message=f"{type(exc).__name__}: {exc}"[:4000],
                                            peer_lost=isinstance(exc, PeerLost)))

    def _finish_step(self, launched: LaunchedStep) -> None:
        """Wait for a launched last-stage step; the replica's reporting rank sends it."""
        try:
            result = self.runner.finish(launched)
        except Exception as exc:
            self._send_failure(launched.step, exc)
            return
        if self.placement.tp_rank == 0:
            self.outputs.send(result)
