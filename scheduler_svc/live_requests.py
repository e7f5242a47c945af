"""Every live request of this scheduler, in one place: its state, its client's stream, and the
replica running it (or none while it is parked, waiting for one).

The frontend adds a request when its stream opens and removes it when the stream ends; the
router places and parks it; engines deliver outputs through `deliver` and hand requests back
when their replica goes down. Each keeps only what is its own to know: the engine's
`Scheduler` holds the requests of its replica's batch, nothing more. Cancelling has one path,
`cancel`, whoever asks (the client going away, the Abort RPC).

Called from the event loop, the engines' threads and the router's thread: one lock guards
everything here, and sinks are called outside it.
"""

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.request import FinishReason, Request, RequestOutput

OutputSink = Callable[[RequestOutput], None]  # thread-safe; called from any thread


class Runner(Protocol):
    """What a request runs on: a replica's engine."""

    @property
    def replica_id(self) -> int: ...

    def abort(self, request_id: str) -> None: ...


class DuplicateRequest(ValueError):
    """A live request already has this id."""


@dataclass(slots=True)
class LiveRequest:
    request: Request
    sink: OutputSink
    runner: Runner | None = None       # the replica engine running it; None while parked
    cancelled: bool = False            # cancel() was called (it ends if handed back)


class LiveRequests:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, LiveRequest] = {}
        self._num_on: Counter[int] = Counter()    # replica id -> requests placed there
        self._num_parked = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    @property
    def num_parked(self) -> int:
        return self._num_parked

    def num_on(self, replica_id: int) -> int:
        """Live requests placed on a replica: the router's measure of its load."""
        return self._num_on[replica_id]

    def add(self, request: Request, sink: OutputSink) -> None:
        """A new request, parked until the router places it."""
        with self._lock:
            if request.request_id in self._live:
                raise DuplicateRequest(f"request_id {request.request_id!r} is already in use")
            self._live[request.request_id] = LiveRequest(request, sink)
            self._num_parked += 1

    def place(self, request_id: str, runner: Runner) -> bool:
        """A parked request now runs on `runner`. False if it is not parked (gone, or placed
        by another thread meanwhile): the caller must not submit it."""
        with self._lock:
            entry = self._live.get(request_id)
            if entry is None or entry.runner is not None:
                return False
            self._num_parked -= 1
            self._num_on[runner.replica_id] += 1
            entry.runner = runner
            return True

    def unplace(self, request_id: str, runner: Runner) -> bool:
        """A request `runner` could not keep (its replica went down, or refused it while going
        down) is parked again. False if it is no longer live, not on `runner`, or was
        cancelled (then it ends here, the abort having gone to a replica that is gone)."""
        with self._lock:
            entry = self._live.get(request_id)
            if entry is None or entry.runner is not runner:
                return False
            self._unplace_locked(entry)
            entry.runner = None
            self._num_parked += 1
            cancelled = entry.cancelled
        if cancelled:
            self.deliver([self._aborted(entry.request)])
        return not cancelled

    def parked(self) -> list[Request]:
        with self._lock:
            return [e.request for e in self._live.values() if e.runner is None]

    def expire_parked(self, now: float) -> int:
        """Parked requests past their deadline end with an error; returns how many."""
        with self._lock:
            expired = [e for e in self._live.values() if e.runner is None
                       and e.request.deadline is not None and now >= e.request.deadline]
            for entry in expired:
                del self._live[entry.request.request_id]
                self._num_parked -= 1
        for entry in expired:
            entry.sink(RequestOutput(entry.request.request_id, [], "", [], FinishReason.ABORT,
                                     error="no replica became ready before the request's "
                                     "deadline"))
        return len(expired)

    def remove(self, request_id: str) -> None:
        """The request's stream ended (finished, failed or cancelled)."""
        with self._lock:
            entry = self._live.pop(request_id, None)
            if entry is not None:
                self._unplace_locked(entry)

    def _unplace_locked(self, entry: LiveRequest) -> None:
        if entry.runner is None:
            self._num_parked -= 1
        else:
            self._num_on[entry.runner.replica_id] -= 1
            if not self._num_on[entry.runner.replica_id]:
                del self._num_on[entry.runner.replica_id]

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs to their clients' streams. A final output ends the request's placement
        (its replica no longer counts it); outputs of requests no longer live are dropped."""
        delivered: list[tuple[OutputSink, RequestOutput]] = []
        with self._lock:
            for out in outputs:
                entry = self._live.get(out.request_id)
                if entry is None:
                    continue
                if out.finish_reason is not None:
                    del self._live[out.request_id]
                    self._unplace_locked(entry)
                delivered.append((entry.sink, out))
        for sink, out in delivered:
            sink(out)

    def cancel(self, request_id: str) -> bool:
        """The one way a request is cancelled. Running: its engine aborts it and delivers the
        final output. Parked: it ends here. False if no such request is live."""
        with self._lock:
            entry = self._live.get(request_id)
            if entry is None:
                return False
            entry.cancelled = True
            runner = entry.runner
        if runner is not None:
            runner.abort(request_id)
        else:
            self.deliver([self._aborted(entry.request)])
        return True

    @staticmethod
    def _aborted(request: Request) -> RequestOutput:
        return RequestOutput(request.request_id, [], "", [], FinishReason.ABORT,
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens)
