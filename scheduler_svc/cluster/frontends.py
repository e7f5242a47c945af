"""The scheduler's front-end processes (`--frontends N`), started and watched by the cluster
process: each serves the client port (they share it, SO_REUSEPORT: the kernel spreads
connections over them), tokenizes, detokenizes and streams (scheduler_svc.frontend).

A front end that exits is started again (its clients' streams broke with it; its requests'
engine cores drop them when the new incarnation says hello). One that cannot start at all
(exit code 2: a model or tokenizer it cannot serve, a port it cannot bind) ends the cluster,
as a fatal error must (restart policies fire).
"""

import logging
import subprocess
import time
from collections.abc import Callable

from scheduler_svc.cluster.wire import FrontendLaunch
from services import subprocesses
from services.codec import Codec

log = logging.getLogger(__name__)

FRONTEND_MODULE = "scheduler_svc.frontend"
FATAL_EXIT = 2            # a front end that cannot serve at all
RESTART_BACKOFF_S = 1.0


class FrontendProcesses:
    def __init__(self, num_frontends: int, launch_for: Callable[[int], FrontendLaunch],
                 env: dict[str, str]) -> None:
        """`launch_for(i)`: front end i's settings; `env`: their environment."""
        self.num_frontends = num_frontends
        self._launch_for = launch_for
        self._env = env
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._restart_at: dict[int, float] = {}
        self.fatal: str | None = None      # why the cluster must end

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    def running(self) -> list[int]:
        """The indices of the front ends whose process runs."""
        return [i for i, p in self._procs.items() if p.poll() is None]

    def start(self) -> None:
        for index in range(self.num_frontends):
            self._start(index)

    def _start(self, index: int) -> None:
        settings = Codec(FrontendLaunch).encode(self._launch_for(index))
        self._procs[index] = subprocesses.spawn(FRONTEND_MODULE, settings, env=self._env)
        log.info("front end %d started (pid %d)", index, self._procs[index].pid)

    def check(self) -> None:
        """Starts again the front ends that exited (not one that cannot serve: `fatal`)."""
        now = time.monotonic()
        for index, proc in list(self._procs.items()):
            code = proc.poll()
            if code is None:
                continue
            if code == FATAL_EXIT:
                self.fatal = f"front end {index} cannot serve (exit code {code}; see its log)"
                return
            restart_at = self._restart_at.setdefault(index, now + RESTART_BACKOFF_S)
            if now >= restart_at:
                log.warning("front end %d exited (code %d); starting it again", index, code)
                del self._restart_at[index]
                self._start(index)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (a front end drains what it still has), SIGKILL after `timeout_s`."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
