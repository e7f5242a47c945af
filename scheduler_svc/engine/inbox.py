"""What other threads hand the engine core's loop: requests to add, aborts, front ends saying
where their outputs go, and wake-ups.

The engine process's command reader (scheduler_svc.engine.service) calls `add` / `abort` /
`hello` / `wake` from its thread; the engine's loop alone takes commands out (`take`). Once
the engine goes down, `close` makes every later `add` refuse and returns the requests added but
never taken (their front ends move them when they hear the engine is down).
"""

import queue
import threading
from dataclasses import dataclass

from scheduler_svc.engine.request import Request, RequestOutput
from scheduler_svc.engine.wire import FrontendHello


@dataclass(slots=True)
class Add:
    request: Request


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Hello:
    hello: FrontendHello


@dataclass(slots=True)
class Deliver:
    """An output made off the engine's thread (a request refused before it was added)."""

    output: RequestOutput


Command = Add | Abort | Hello | Deliver | None      # None only wakes the engine


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

    def hello(self, hello: FrontendHello) -> None:
        self._queue.put(Hello(hello))

    def deliver(self, output: RequestOutput) -> None:
        self._queue.put(Deliver(output))

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
