"""Fakes for the cluster's tests: engine core processes that never start (real `EngineProcess`
handles around a stand-in for their Popen), an `EngineControl` that records what membership
starts and stops, and the reports an engine core would send."""

from pathlib import Path

import zmq

from scheduler_svc.cluster.engines import EngineProcess
from scheduler_svc.cluster.membership import Membership
from scheduler_svc.cluster.placement import Replica
from scheduler_svc.config import ServerConfig
from scheduler_svc.engine.config import EngineConfig, SchedulerConfig
from scheduler_svc.engine.wire import EngineLaunch, EngineReport, EngineStats
from services.model_config import load_model_config

STEP_ADDRESS = "tcp://127.0.0.1:9"


class FakeProc:
    """What EngineProcess uses of a subprocess.Popen."""

    def __init__(self) -> None:
        self.pid = 4242
        self.returncode: int | None = None
        self.num_kills = 0

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.num_kills += 1
        if self.returncode is None:
            self.returncode = -9

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class FakeEngines:
    """Membership's EngineControl: each engine core is a real EngineProcess handle whose
    process is a FakeProc. `exit_on_stop`: a stopped engine core's process exits at once (as
    a real one does soon after EngineStop); otherwise it runs until the test ends it."""

    def __init__(self, exit_on_stop: bool = True) -> None:
        self.exit_on_stop = exit_on_stop
        self.started: list[EngineProcess] = []
        self.stops: list[tuple[int, str]] = []      # (replica id, reason)
        self._next_epoch = 1_000

    def start_engine(self, replica: Replica, config: EngineConfig) -> EngineProcess:
        self._next_epoch += 1
        launch = EngineLaunch(
            config=config, engine_epoch=self._next_epoch, parent_pid=1,
            worker_output_address=replica.output_address,
            report_address="tcp://127.0.0.1:1", kvcache_address="tcp://127.0.0.1:9",
            worker_step_addresses=[w.step_address for w in replica.workers], tp_size=1)
        engine = EngineProcess(config, launch, FakeProc())  # type: ignore[arg-type]
        self.started.append(engine)
        return engine

    def stop_engine(self, engine: EngineProcess, reason: str) -> None:
        self.stops.append((engine.replica_id, reason))
        engine.stop_message(reason)
        if self.exit_on_stop:
            proc(engine).returncode = 0


def proc(engine: EngineProcess) -> FakeProc:
    return engine.proc  # type: ignore[return-value]


def engine_stats(kv_ok: bool = True, num_kv_blocks: int = 64) -> EngineStats:
    return EngineStats(
        num_kv_blocks=num_kv_blocks, num_usable_blocks=num_kv_blocks - 1,
        num_free_blocks=num_kv_blocks - 1, num_running=0, num_waiting=0, num_preemptions=0,
        num_steps=0, num_kv_recoveries=0, kv_ok=kv_ok, forward_gap_ms_total=0.0,
        num_forward_gaps=0, num_prompt_tokens_admitted=0, num_cached_tokens_admitted=0)


def command_address(engine: EngineProcess) -> str:
    return f"tcp://127.0.0.1:{41000 + engine.replica_id}"


def report(engine: EngineProcess, ready: bool = True, kv_ok: bool = True,
           down: str | None = None, epoch: int | None = None) -> EngineReport:
    """An engine core's report: its command socket, counters, ready or down."""
    return EngineReport(replica_id=engine.replica_id,
                        engine_epoch=engine.epoch if epoch is None else epoch, ready=ready,
                        command_address=command_address(engine), stats=engine_stats(kv_ok),
                        down=down)


def make_membership(model_path: Path, ctx: zmq.Context, engines: FakeEngines | None = None,
                    **config: object) -> Membership:
    """Membership of the default model with fake engine cores; its monitor is not started
    (tests call its checks)."""
    server = ServerConfig(model_path=str(model_path), model_name="",
                          kvcache_address="tcp://127.0.0.1:9", **config)  # type: ignore[arg-type]
    return Membership(server, SchedulerConfig(block_size=16), load_model_config(model_path),
                      ctx, engines or FakeEngines())


def form_replica(membership: Membership, blocks: dict[str, int], epoch: int = 1) -> Replica:
    """Registers `blocks`' workers (in order: rank 0 first) and reports their capacities; the
    replica they form (its engine core started if every rank fits a pool)."""
    for worker_id in blocks:
        membership.register(worker_id, epoch, "cpu", 1, STEP_ADDRESS, "")
    for worker_id, num_blocks in blocks.items():
        membership.report_capacity(worker_id, epoch, num_blocks)
    return membership.replicas[membership.workers[worker_id].replica_id]
