"""Structured output's compile pool: a few threads, apart from the tokenizer's
(scheduler_svc.frontend.prompts), each waiting on one compile at a time within a time budget.

Owned by `Grammars` (scheduler_svc.frontend.grammar), whose `compile_async` is what the event
loop awaits. The compiles themselves run in child processes of the front end's compile server
(scheduler_svc.frontend.compile_server), which `cancel_fn` kills: xgrammar's compiles cannot
be interrupted in-process, and a hostile schema can take a minute. So:

- a request's budget (`--max-grammar-compile-s`) counts from when it asks, queueing included;
  past it the request is refused (`CompileTimeout`, a StructuredOutputError naming the field)
  and its compile is killed: the thread, and the CPU, are free within milliseconds;
- a constraint that ran past the budget is remembered (bounded), and refused at once when
  asked again: the same hostile schema never burns a core twice;
- one that only queued past it (every thread busy with others' compiles) is not held against
  it: it gets `CompilePoolBusy`, a load refusal (RESOURCE_EXHAUSTED, HTTP 429: try again),
  not a 400 telling its client to simplify a schema that never ran;
- requests for a constraint already compiling wait for that compile (it runs once).

The limits checked before compiling (structured_output.py: size, nesting depth, enum items)
keep an ordinary constraint far inside the budget; the budget is the backstop.
"""

import asyncio
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

from scheduler_svc.frontend.structured_output import FIELD, StructuredOutputError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

DEFAULT_MAX_COMPILE_S = 5.0   # --max-grammar-compile-s
COMPILE_THREADS = 2           # compiles at once
MAX_REMEMBERED_OVERRUNS = 256  # constraints that overran, refused at once when seen again


class CompileTimeout(StructuredOutputError):
    """The constraint did not compile within the budget."""


class CompilePoolBusy(RuntimeError):
    """The budget ran out while the constraint waited for a compile thread: the server is
    busy, the constraint is not at fault (RESOURCE_EXHAUSTED)."""


class GrammarPool(Generic[K, V]):
    """Runs `compile_fn(key)` on the pool's threads, one compile per key at a time;
    `cancel_fn(key)` must make a running `compile_fn(key)` return or raise soon."""

    def __init__(self, compile_fn: Callable[[K], V], cancel_fn: Callable[[K], None],
                 max_compile_s: float = DEFAULT_MAX_COMPILE_S,
                 num_threads: int = COMPILE_THREADS) -> None:
        self.max_compile_s = max_compile_s
        self._compile_fn, self._cancel_fn = compile_fn, cancel_fn
        self._queue: queue.SimpleQueue[tuple[K, Future[V]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[K, Future[V]] = {}      # queued or compiling, by key
        self._overran: OrderedDict[K, None] = OrderedDict()
        self.num_threads = num_threads
        self.num_compiled = 0             # compiles that ran to their end (ok or refused)
        self.num_timeouts = 0             # requests refused for the budget
        self.num_killed = 0               # compiles cancelled past their budget
        for _ in range(num_threads):
            threading.Thread(target=self._work, daemon=True, name="grammar-compile").start()

    def close(self) -> None:
        """Workers exit once their compile ends."""
        for _ in range(self.num_threads):
            self._queue.put(None)

    async def compile(self, key: K, what: str = FIELD) -> V:
        """`key`'s result; raises what `compile_fn` raises, or CompileTimeout (naming `what`,
        the request's field) past the budget, or CompilePoolBusy."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_compile_s
        with self._lock:
            if key in self._overran:
                self._overran.move_to_end(key)
                self.num_timeouts += 1
                raise self._timeout(what, again=True)
            future = self._running.get(key)
            if future is None:
                future = Future()
                self._running[key] = future
                self._queue.put((key, future))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                          max(0.0, deadline - loop.time()))
        except TimeoutError:
            if self._overrun(key, future):
                raise self._timeout(what, again=False) from None
            raise CompilePoolBusy(
                f"{what} waited {self.max_compile_s:g} s (--max-grammar-compile-s) for a "
                f"grammar compile thread, all busy with other requests' grammars; try again "
                f"later") from None
        except _Killed:
            # Another request's budget ran out on the same compile: this key overran.
            raise self._timeout(what, again=True) from None

    def _timeout(self, what: str, again: bool) -> CompileTimeout:
        before = " (it ran past it before)" if again else ""
        return CompileTimeout(f"{what} did not compile within the {self.max_compile_s:g} s "
                              f"budget (--max-grammar-compile-s){before}; simplify it")

    def _work(self) -> None:
        """A worker thread: compiles queued keys until told to stop."""
        while (item := self._queue.get()) is not None:
            key, future = item
            if not future.set_running_or_notify_cancel():
                continue                    # its requests gave up while it queued
            result: V | None = None
            error: BaseException | None = None
            try:
                result = self._compile_fn(key)
            except BaseException as exc:   # handed to the awaiting requests, raised there
                error = exc
            with self._lock:               # before the result: a later request compiles anew
                self.num_compiled += 1
                if self._running.get(key) is future:
                    del self._running[key]
                if key in self._overran:
                    error = _Killed()      # whatever it raised on the way out
            if error is None:
                future.set_result(result)  # type: ignore[arg-type]
            else:
                future.set_exception(error)

    def _overrun(self, key: K, future: Future[V]) -> bool:
        """The budget ran out while `key` compiled (or queued). Compiling: remembered as too
        slow and cancelled; True. Still queued (the pool was busy: not its fault): False."""
        with self._lock:
            self.num_timeouts += 1
            if future.cancel():
                self._running.pop(key, None)
                return False
            if future.done() or key in self._overran:
                return True
            self._overran[key] = None
            while len(self._overran) > MAX_REMEMBERED_OVERRUNS:
                self._overran.popitem(last=False)
            self.num_killed += 1
        self._cancel_fn(key)
        return True


class _Killed(Exception):
    """A compile cancelled past its budget (the waiters' CompileTimeout)."""
