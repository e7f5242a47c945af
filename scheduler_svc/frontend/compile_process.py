"""The front end's side of its grammar compile server (scheduler_svc.frontend.compile_server):
starts it, sends it compiles, hands the replies to the callers, kills a compile on demand.

`compile` blocks its caller (a compile pool thread, scheduler_svc.frontend.grammar_pool) until
the reply; `cancel` makes the server SIGKILL that compile's child, and the blocked caller gets
CompileCancelled. One reader thread takes every reply. A server that dies (killed, out of
memory) fails the compiles it held with CompileServerLost, and the next compile starts a new
one.
"""

import itertools
import subprocess
import sys
import threading
from collections.abc import Hashable
from concurrent.futures import Future

import msgspec

from scheduler_svc.frontend.compile_server import (
    MAX_REPLY_BYTES,
    Cancel,
    Cancelled,
    Compile,
    Done,
    Error,
    Failed,
    FrameError,
    FromServer,
    Init,
    Ready,
    encode_frame,
    read_frame,
)

START_TIMEOUT_S = 120.0     # importing xgrammar and reading the vocabulary: ~2 s here


class CompileFailed(ValueError):
    """The constraint does not compile; the reason is xgrammar's."""


class CompileCancelled(RuntimeError):
    """The compile was killed (`cancel`)."""


class CompileServerLost(RuntimeError):
    """The compile server is gone, or could not start."""


class CompileProcess:
    """One compile server, started on first use; thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: list[int]) -> None:
        self._init = Init(tokenizer_json, vocab_size, stop_ids)
        self._lock = threading.Lock()          # the process, the jobs, writes to its stdin
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready: Future[bytes] | None = None   # the vocabulary, once it answers init
        self._jobs: dict[int, Future[bytes]] = {}
        self._job_of: dict[Hashable, int] = {}     # a key's compile in flight
        self._job_ids = itertools.count(1)
        self.num_started = 0                   # servers started (restarts after a loss)
        self.num_cancelled = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def vocabulary(self) -> bytes:
        """The tokenizer's vocabulary as xgrammar serializes it (starts the server)."""
        with self._lock:
            ready = self._ensure_started()
        try:
            return ready.result(START_TIMEOUT_S)
        except TimeoutError:
            raise CompileServerLost(
                f"the grammar compile server did not start in {START_TIMEOUT_S:g} s") from None

    def compile(self, key: Hashable, kind: str, text: str) -> bytes:
        """The compiled grammar (xgrammar's serialized JSON) of `text`; raises CompileFailed,
        CompileCancelled (`cancel(key)` was called) or CompileServerLost."""
        self.vocabulary()
        future: Future[bytes] = Future()
        with self._lock:
            job = next(self._job_ids)
            self._jobs[job] = future
            self._job_of[key] = job
            self._write(Compile(job, kind, text))   # type: ignore[arg-type]
        try:
            return future.result()
        finally:
            with self._lock:
                self._jobs.pop(job, None)
                if self._job_of.get(key) == job:
                    del self._job_of[key]

    def cancel(self, key: Hashable) -> None:
        """Kills `key`'s compile if one is running; its caller gets CompileCancelled."""
        with self._lock:
            job = self._job_of.get(key)
            if job is not None:
                self._write(Cancel(job))

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            proc.stdin.close()                 # type: ignore[union-attr]
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _ensure_started(self) -> "Future[bytes]":
        if self._proc is not None and self._proc.poll() is None and self._ready is not None:
            return self._ready
        self.num_started += 1
        # Its own session: a signal sent to the front end's process group (Ctrl-C) is the
        # front end's to handle; the server follows when its stdin closes.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler_svc.frontend.compile_server"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self._ready = Future()
        threading.Thread(target=self._read, args=(self._proc, self._ready), daemon=True,
                         name="grammar-compile-replies").start()
        self._write(self._init)
        return self._ready

    def _write(self, message: Init | Compile | Cancel) -> None:
        """Sends `message` (the lock is held); a server that is gone fails it on the reader."""
        try:
            self._proc.stdin.write(encode_frame(message))      # type: ignore[union-attr]
            self._proc.stdin.flush()                           # type: ignore[union-attr]
        except (BrokenPipeError, OSError, AttributeError):
            pass

    def _read(self, proc: "subprocess.Popen[bytes]", ready: "Future[bytes]") -> None:
        """The reader thread of one server: every reply, until it ends."""
        error = "the grammar compile server exited"
        decoder = msgspec.msgpack.Decoder(FromServer)
        try:
            while (message := read_frame(proc.stdout, MAX_REPLY_BYTES,  # type: ignore[arg-type]
                                         decoder)) is not None:
                self._deliver(message, ready)
        except (FrameError, OSError) as exc:
            error = f"the grammar compile server's reply was malformed: {exc}"
            proc.kill()
        proc.wait()
        with self._lock:
            if self._proc is proc:
                self._proc = None
            pending = list(self._jobs.values())
        lost = CompileServerLost(f"{error} (status {proc.returncode})")
        for future in [ready, *pending]:
            if not future.done():
                future.set_exception(lost)

    def _deliver(self, message: object, ready: "Future[bytes]") -> None:
        if isinstance(message, Ready):
            ready.set_result(message.vocabulary)
            return
        if isinstance(message, Failed):
            ready.set_exception(CompileServerLost(
                f"the grammar compile server could not start: {message.error}"))
            return
        assert isinstance(message, Done | Error | Cancelled)
        with self._lock:
            future = self._jobs.get(message.job)
        if future is None or future.done():
            return                               # a reply that crossed a cancel
        if isinstance(message, Done):
            future.set_result(message.grammar)
        elif isinstance(message, Error):
            future.set_exception(CompileFailed(message.error))
        else:
            self.num_cancelled += 1
            future.set_exception(CompileCancelled(f"compile {message.job} was killed"))
