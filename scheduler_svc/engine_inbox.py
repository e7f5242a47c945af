"""What other threads hand a replica's engine thread: requests to add, aborts, and wake-ups.

The gRPC side and the router call `add` / `abort` / `wake` from any thread; the engine thread
alone takes commands out (`take`). Once the engine goes down, `close` makes every later `add`
refuse (the caller places the request elsewhere) and returns the requests added but never
taken, so that none is lost between the two.
"""

import queue
import threading
from dataclasses import dataclass

from scheduler_svc.request import Request


@dataclass(slots=True)
class Add:
    request: Request


@dataclass(slots=True)
class Abort:
    request_id: str


Command = Add | Abort | None      # None only wakes the engine


class EngineInbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()     # add vs. close
        self._closed = False

    def add(self, request: Request) -> bool:
        """False once closed."""
        with self._lock:
            if self._closed:
                return False
            self._queue.put(Add(request))
            return True

    def abort(self, request_id: str) -> None:
        self._queue.put(Abort(request_id))

    def wake(self) -> None:
        self._queue.put(None)

    def take(self, block: bool = False, timeout_s: float | None = None) -> list[Command]:
        """Every command waiting; with `block`, waits for the first (up to `timeout_s`)."""
        try:
            commands = [self._queue.get(block=block, timeout=timeout_s if block else None)]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._queue.get_nowait())
            except queue.Empty:
                return commands

    def close(self) -> list[Request]:
        """No more adds; the requests added but not taken."""
        with self._lock:
            self._closed = True
        return [c.request for c in self.take() if isinstance(c, Add)]
