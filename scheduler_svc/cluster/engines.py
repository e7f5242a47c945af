"""The cluster's handle on each replica's engine core process: started once every rank of the
replica has reported its capacity, followed through its reports, stopped when the replica
goes down.

`Membership` (membership.py) starts an `EngineProcess` and asks it to stop; the hub
(hub.py) hands it the engine core's reports and sends what it queues for the engine core.
"""

import logging
import os
import subprocess
import time
from collections.abc import Callable

from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.engine.wire import EngineLaunch, EngineReport, EngineStats, EngineStop
from services import subprocesses
from services.codec import Codec

log = logging.getLogger(__name__)

ENGINE_MODULE = "scheduler_svc.engine"
STOP_GRACE_S = 5.0        # an engine core told to stop that is still there is killed


class EngineProcess:
    """One engine core process, as the cluster sees it. Its fields are written by the hub's
    thread (reports) and read by any (one attribute at a time, no lock needed)."""

    def __init__(self, config: EngineConfig, launch: EngineLaunch,
                 proc: subprocess.Popen[bytes]) -> None:
        self.config = config
        self.epoch = launch.engine_epoch
        self.proc = proc
        self.ready = False                  # its pool and every rank's cache are up
        self.kv_ok = True                   # kvcache_svc holds its pool
        self.command_address: str | None = None
        self.stats: EngineStats | None = None
        self.down_reason: str | None = None     # it said it stopped, or it exited
        self.stop_sent_at: float | None = None  # when the cluster told it to stop
        self.reaped = False                     # membership saw it exit

    @classmethod
    def start(cls, config: EngineConfig, worker_output_address: str, report_address: str,
              kvcache_address: str, worker_step_addresses: list[str], tp_size: int,
              log_level: str, command_host: str = "127.0.0.1") -> "EngineProcess":
        launch = EngineLaunch(
            config=config, engine_epoch=time.time_ns(), parent_pid=os.getpid(),
            worker_output_address=worker_output_address, report_address=report_address,
            kvcache_address=kvcache_address, worker_step_addresses=worker_step_addresses,
            tp_size=tp_size, command_host=command_host, log_level=log_level)
        proc = subprocesses.spawn(ENGINE_MODULE, Codec(EngineLaunch).encode(launch))
        log.info("replica %d: engine core started (pid %d, epoch %d)", config.replica_id,
                 proc.pid, launch.engine_epoch)
        return cls(config, launch, proc)

    @property
    def replica_id(self) -> int:
        return self.config.replica_id

    @property
    def alive(self) -> bool:
        return self.down_reason is None

    def take_report(self, report: EngineReport) -> None:
        """Applies a report of this instance (the hub checked the epoch)."""
        if report.command_address is not None:
            self.command_address = report.command_address
        if report.stats is not None:
            self.stats = report.stats
            self.kv_ok = report.stats.kv_ok
        self.ready = self.ready or report.ready
        if report.down is not None and self.down_reason is None:
            self.down_reason = report.down

    def exited(self) -> int | None:
        """Its exit code once the process has ended; None while it runs."""
        return self.proc.poll()

    def stop_message(self, reason: str) -> EngineStop | None:
        """What to send to make it stop, once (None when already asked or not reachable)."""
        if self.stop_sent_at is not None:
            return None
        self.stop_sent_at = time.monotonic()
        return EngineStop(reason=reason[:4096]) if self.command_address else None

    def overdue(self) -> bool:
        """Told to stop long enough ago and still running: the caller kills it."""
        return (self.stop_sent_at is not None and self.exited() is None
                and time.monotonic() - self.stop_sent_at > STOP_GRACE_S)

    def kill(self) -> None:
        if self.exited() is None:
            self.proc.kill()
            self.proc.wait()


def stop_all(engines: list[EngineProcess], stop: Callable[[EngineProcess], None],
             timeout_s: float) -> None:
    """Every engine core still there told to stop (`stop`), then killed if still there after
    `timeout_s`."""
    for engine in engines:
        if engine.exited() is None:
            stop(engine)
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        while engine.exited() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        engine.kill()
