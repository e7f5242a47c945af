"""Structured output's compile pool: grammars compile on their own few threads, apart from the
tokenizer's (scheduler_svc.frontend.prompts), each within a time budget.

Owned by `Grammars` (scheduler_svc.frontend.grammar), whose `compile_async` is what the event
loop awaits. Why threads, not a process: xgrammar (0.2) releases the GIL while it compiles
(measured: a thread that sleeps 0.1 ms 200 times takes 0.07 s beside a compile, 0.04 s alone;
a process would cost ~3 s and ~260 MiB each, as xgrammar imports torch and transformers), so a
compile stalls neither the loop nor the tokenizer threads. What it takes is CPU, hence the
threads' lower priority (niceness; an overrunning compile's the lowest). It cannot be
interrupted (no timeout, no cancel in its API). So:

- a request's budget (`--max-grammar-compile-s`) counts from when it asks, queueing included;
  past it the request is refused (`CompileTimeout`, a StructuredOutputError naming the field)
  while its compile runs on to its end in the background;
- a fresh worker thread takes an overrunning compile's place at once, so the pool is not
  left blocked, for up to `max_overrun` of them at a time (past that they keep their place:
  the threads never number more than `num_threads + max_overrun`);
- a constraint that ran past the budget is remembered (bounded), and refused at once when
  asked again: the same hostile schema never burns a thread twice;
- one that only queued past it (every thread busy, e.g. with others' overrunning compiles)
  is not held against it: it gets `CompilePoolBusy`, a load refusal (RESOURCE_EXHAUSTED,
  HTTP 429: try again), not a 400 telling its client to simplify a schema that never ran;
- requests for a constraint already compiling wait for that compile (it runs once).

The limits checked before compiling (structured_output.py: size, nesting depth, enum items)
keep an ordinary constraint far inside the budget; the budget is the backstop.
"""

import asyncio
import os
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
COMPILE_THREADS = 2           # compiles at once within their budget
MAX_OVERRUN = 2               # compiles past their budget that no longer hold a slot
MAX_REMEMBERED_OVERRUNS = 256  # constraints that overran, refused at once when seen again
COMPILE_NICENESS = 10         # the compile threads' CPU priority (nice), below the rest
OVERRUN_NICENESS = 19         # an overrunning compile's: the least, as nobody waits for it


class CompileTimeout(StructuredOutputError):
    """The constraint did not compile within the budget."""


class CompilePoolBusy(RuntimeError):
    """The budget ran out while the constraint waited for a compile thread: the server is
    busy, the constraint is not at fault (RESOURCE_EXHAUSTED)."""


class GrammarPool(Generic[K, V]):
    """Runs `compile_fn(key)` on the pool's threads, one compile per key at a time."""

    def __init__(self, compile_fn: Callable[[K], V], max_compile_s: float = DEFAULT_MAX_COMPILE_S,
                 num_threads: int = COMPILE_THREADS, max_overrun: int = MAX_OVERRUN) -> None:
        self.max_compile_s = max_compile_s
        self._compile_fn = compile_fn
        self._max_overrun = max_overrun
        self._queue: queue.SimpleQueue[tuple[K, Future[V]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[K, Future[V]] = {}      # queued or compiling, by key
        self._overran: OrderedDict[K, None] = OrderedDict()
        self._replaced: set[int] = set()            # ids of overrunning futures replaced
        self._thread_ids: dict[int, int] = {}       # id of a compiling future -> its thread
        self.num_threads = 0                        # worker threads alive
        self.num_overrunning = 0          # compiles past their budget, still running
        self.num_compiled = 0             # compiles that ran to their end (ok or refused)
        self.num_timeouts = 0             # requests refused for the budget
        for _ in range(num_threads):
            self._start_worker()

    def close(self) -> None:
        """Workers exit once their compile ends (an overrunning one runs on to its end)."""
        for _ in range(self.num_threads):
            self._queue.put(None)

    async def compile(self, key: K, what: str = FIELD) -> V:
        """`key`'s result; raises what `compile_fn` raises, or CompileTimeout (naming `what`,
        the request's field) past the budget."""
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

    def _timeout(self, what: str, again: bool) -> CompileTimeout:
        before = " (it ran past it before)" if again else ""
        return CompileTimeout(f"{what} did not compile within the {self.max_compile_s:g} s "
                              f"budget (--max-grammar-compile-s){before}; simplify it")

    def _start_worker(self) -> None:
        self.num_threads += 1
        threading.Thread(target=self._work, daemon=True, name="grammar-compile").start()

    def _work(self) -> None:
        """A worker thread: compiles queued keys until told to stop, or until it overran and
        a replacement took its place."""
        # Below the loop's, the tokenizer's and the engine's threads: a compile burns a whole
        # core, and on a small machine those then wait for CPU.
        _set_niceness(threading.get_native_id(), COMPILE_NICENESS)
        while (item := self._queue.get()) is not None:
            key, future = item
            with self._lock:
                if not future.set_running_or_notify_cancel():
                    continue                # its requests gave up while it queued
                self._thread_ids[id(future)] = threading.get_native_id()
            result: V | None = None
            error: BaseException | None = None
            try:
                result = self._compile_fn(key)
            except BaseException as exc:   # handed to the awaiting requests, raised there
                error = exc
            with self._lock:               # before the result: a later request compiles anew
                self.num_compiled += 1
                self._thread_ids.pop(id(future), None)
                if self._running.get(key) is future:
                    del self._running[key]
                replaced = id(future) in self._replaced
                if replaced:
                    self._replaced.discard(id(future))
                    self.num_overrunning -= 1
                    self.num_threads -= 1
            if error is None:
                future.set_result(result)  # type: ignore[arg-type]
            else:
                future.set_exception(error)
            if replaced:
                return
        with self._lock:
            self.num_threads -= 1

    def _overrun(self, key: K, future: Future[V]) -> bool:
        """The budget ran out while `key` compiled (or queued). Compiling: remembered as too
        slow, and replaced by a fresh worker, up to `max_overrun` at a time; True. Still
        queued (the pool was busy: not its fault): False."""
        with self._lock:
            self.num_timeouts += 1
            if future.cancel():
                self._running.pop(key, None)
                return False
            if future.done():
                return True
            self._overran[key] = None
            while len(self._overran) > MAX_REMEMBERED_OVERRUNS:
                self._overran.popitem(last=False)
            if id(future) in self._replaced:
                return True
            _set_niceness(self._thread_ids.get(id(future)), OVERRUN_NICENESS)
            if self.num_overrunning < self._max_overrun:
                self._replaced.add(id(future))
                self.num_overrunning += 1
                self._start_worker()
            return True


def _set_niceness(thread_id: int | None, niceness: int) -> None:
    """One thread's CPU priority (Linux takes a thread id here; elsewhere it is left be)."""
    if thread_id is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id, niceness)
    except (AttributeError, OSError):
        pass
