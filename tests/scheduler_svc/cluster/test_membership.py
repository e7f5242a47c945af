"""Membership with fake engine cores (the e2e tests run real ones): a replica's engine core
starts once every rank reported its capacity and serves (is in the cluster's state) only after
its ready report; an engine core that goes down, exits, or whose replica loses a worker
(heartbeat, a newer epoch) takes its replica out and is listed gone for the front ends;
dtypes per replica, one GPU per worker, and a replica whose workers cannot hold its KV pool
is refused before it starts. Layer and rendezvous arithmetic is test_placement.py."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from scheduler_svc.cluster.membership import MAX_DOWN_REPLICAS, Membership
from scheduler_svc.cluster.placement import RegistrationError, ReplicaState
from scheduler_svc.cluster.wire import ReplicaEntry
from services.kv_wire import DropPool
from tests.scheduler_svc.cluster.fakes import (
    STEP_ADDRESS,
    FakeEngines,
    command_address,
    form_replica,
    make_membership,
    proc,
    report,
)


@pytest.fixture
def engines() -> FakeEngines:
    return FakeEngines()


@pytest.fixture
def cluster(model_path: Path, ctx: zmq.Context, engines: FakeEngines) -> Iterator[Membership]:
    c = make_membership(model_path, ctx, engines, heartbeat_timeout_s=0.5)
    c.kv.reachable = True
    yield c
    c.shutdown()


def register(cluster: Membership, worker_id: str, epoch: int = 1, **kw: object) -> int:
    return cluster.register(worker_id, epoch, "cpu", 1, STEP_ADDRESS, "",  # type: ignore[arg-type]
                            **kw).replica_id


class Probe:
    """kvcache_svc as the monitor's probe sees it: records what it is sent."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def call(self, message: object, timeout_ms: int) -> None:
        self.sent.append(message)
        return None


def drops(probe: Probe) -> list[object]:
    """The pools the monitor's pass dropped (it probes reachability first)."""
    return [m for m in probe.sent if isinstance(m, DropPool)]


# ---------------------------------------------------------------- an engine core's life


def test_the_engine_core_starts_when_every_rank_reported(model_path: Path, ctx: zmq.Context,
                                                         engines: FakeEngines) -> None:
    cluster = make_membership(model_path, ctx, engines, tp_size=2)
    try:
        register(cluster, "w0")
        register(cluster, "w1")
        cluster.report_capacity("w0", 1, 60)
        assert engines.started == [] and cluster.replicas[0].state == ReplicaState.FORMING
        cluster.report_capacity("w1", 1, 50)
        (engine,) = engines.started
        replica = cluster.replicas[0]
        assert replica.engine is engine and replica.state == ReplicaState.STARTING
        config = engine.config
        assert (config.replica_id, config.num_kv_blocks) == (0, 50)    # the smallest rank's
        assert config.eos_token_ids == tuple(cluster.model.eos_token_ids)
        assert config.vocab_size == cluster.model.vocab_size
        assert config.scheduler_epoch == cluster.epoch
        assert cluster.max_kv_tokens() == 49 * 16
    finally:
        cluster.shutdown()


def test_a_replica_serves_only_after_its_engine_cores_ready_report(
        cluster: Membership, engines: FakeEngines) -> None:
    changes: list[int] = []
    cluster.on_change = lambda: changes.append(1)
    replica = form_replica(cluster, {"w0": 64})
    (engine,) = engines.started
    assert cluster.cluster_state().ready == [] and not cluster.is_ready()
    cluster.engine_report(report(engine, ready=False))       # its counters, not ready yet
    assert cluster.cluster_state().ready == [] and replica.state == ReplicaState.STARTING
    cluster.engine_report(report(engine, epoch=engine.epoch + 1))   # another instance's
    assert cluster.cluster_state().ready == [] and not changes
    cluster.engine_report(report(engine))
    state = cluster.cluster_state()
    assert state.ready == [ReplicaEntry(0, engine.epoch, command_address(engine), 64)]
    assert replica.state == ReplicaState.READY and cluster.is_ready() and changes
    assert (state.kv_reachable, state.draining, state.gone) == (True, False, [])
    assert state.max_kv_tokens == 63 * 16
    # kvcache_svc lost its pool: no new requests there until the engine core re-created it.
    cluster.engine_report(report(engine, kv_ok=False))
    assert cluster.cluster_state().ready == []
    cluster.engine_report(report(engine))
    assert [r.replica_id for r in cluster.cluster_state().ready] == [0]
    cluster.draining = True
    assert cluster.cluster_state().draining


def test_an_engine_core_that_says_it_went_down_takes_its_replica_down(
        cluster: Membership, engines: FakeEngines) -> None:
    replica = form_replica(cluster, {"w0": 64})
    (engine,) = engines.started
    cluster.engine_report(report(engine))
    seq = cluster.cluster_state().seq
    cluster.engine_report(report(engine, down="a rank lost its peer"))
    state = cluster.cluster_state()
    assert state.ready == [] and state.gone == [(0, engine.epoch)] and state.seq > seq
    assert replica.state == ReplicaState.DOWN
    assert not cluster.heartbeat("w0", 1)              # its ranks register again
    assert engines.stops == []                         # it stops by itself
    proc(engine).returncode = 0
    cluster.check_engines()
    assert cluster.cluster_state().gone == [(0, engine.epoch)]    # listed once
    probe = Probe()
    cluster._watch_kvcache(probe)  # type: ignore[arg-type]
    assert drops(probe) == []                          # it dropped its own pool


def test_an_engine_core_that_exits_unannounced_takes_its_replica_down(
        cluster: Membership, engines: FakeEngines) -> None:
    replica = form_replica(cluster, {"w0": 64})
    (engine,) = engines.started
    cluster.engine_report(report(engine))
    proc(engine).returncode = -11                      # crashed
    cluster.check_engines()
    assert replica.state == ReplicaState.DOWN
    assert cluster.cluster_state().gone == [(0, engine.epoch)]
    probe = Probe()
    cluster._watch_kvcache(probe)  # type: ignore[arg-type]
    assert drops(probe) == [DropPool(replica_id=0)]    # its pool outlived it


def test_silent_worker_takes_its_replica_down(cluster: Membership,
                                              engines: FakeEngines) -> None:
    replica = form_replica(cluster, {"w0": 64}, epoch=5)
    (engine,) = engines.started
    cluster.engine_report(report(engine))
    assert cluster.heartbeat("w0", 5)
    cluster._check_heartbeats()
    assert replica.state == ReplicaState.READY
    cluster.workers["w0"].last_heartbeat -= 1.0       # past the 0.5 s timeout
    cluster._check_heartbeats()
    assert replica.state == ReplicaState.DOWN
    ((replica_id, reason),) = engines.stops
    assert replica_id == 0 and "no heartbeat" in reason
    assert engine.stop_sent_at is not None
    state = cluster.cluster_state()
    assert state.ready == [] and state.gone == [(0, engine.epoch)]
    assert not cluster.heartbeat("w0", 5)             # it must register again
    with pytest.raises(RegistrationError, match="not newer"):
        register(cluster, "w0", epoch=5)
    assert register(cluster, "w0", epoch=6) != replica.replica_id


def test_a_worker_registering_again_takes_its_old_replica_down(
        cluster: Membership, engines: FakeEngines) -> None:
    old = form_replica(cluster, {"w0": 64}, epoch=1)
    (engine,) = engines.started
    cluster.engine_report(report(engine))
    new = form_replica(cluster, {"w0": 64}, epoch=2)
    assert old.state == ReplicaState.DOWN and new.replica_id != old.replica_id
    assert engines.stops == [(old.replica_id, "worker w0 registered again (epoch 1 -> 2)")]
    assert cluster.cluster_state().gone == [(old.replica_id, engine.epoch)]
    (_, restarted) = engines.started
    cluster.engine_report(report(restarted))
    assert [r.replica_id for r in cluster.cluster_state().ready] == [new.replica_id]


def test_an_engine_core_that_does_not_stop_is_killed(
        cluster: Membership, engines: FakeEngines) -> None:
    engines.exit_on_stop = False
    form_replica(cluster, {"w0": 64})
    (engine,) = engines.started
    cluster.engine_report(report(engine))
    with cluster._lock:
        cluster._replica_lost_locked(0, "test: lost")
    cluster.check_engines()
    assert proc(engine).num_kills == 0                 # within its grace period
    assert engine.stop_sent_at is not None
    engine.stop_sent_at -= 60.0
    cluster.check_engines()
    assert proc(engine).num_kills == 1 and engine.exited() is not None


def test_down_replicas_are_not_kept_forever(cluster: Membership,
                                            engines: FakeEngines) -> None:
    # 40 one-rank replicas come and go (a stream of registrations, or churn): only the last
    # MAX_DOWN_REPLICAS stay listed, once their engine cores have exited; one whose engine
    # core still runs stays until it has.
    engines.exit_on_stop = False
    lingering = form_replica(cluster, {"slow": 64})
    with cluster._lock:
        cluster._replica_lost_locked(lingering.replica_id, "gone")
    engines.exit_on_stop = True
    for i in range(40):
        replica = form_replica(cluster, {f"w{i}": 64})
        with cluster._lock:
            cluster._replica_lost_locked(replica.replica_id, "gone")
    down = [r for r in cluster.replicas.values() if r.state == ReplicaState.DOWN]
    assert len(down) == len(cluster.replicas) == MAX_DOWN_REPLICAS + 1
    assert lingering.replica_id in cluster.replicas
    assert sorted(cluster.workers) == sorted(
        ["slow"] + [f"w{i}" for i in range(40 - MAX_DOWN_REPLICAS, 40)])
    assert len(cluster.cluster_state().gone) <= 64


def test_kvcache_reachability_is_the_probes_and_decides_readiness(
        cluster: Membership, engines: FakeEngines) -> None:
    form_replica(cluster, {"w0": 64})
    cluster.engine_report(report(engines.started[0]))
    assert cluster.is_ready()
    changes: list[int] = []
    cluster.on_change = lambda: changes.append(1)
    cluster._watch_kvcache(Probe())  # type: ignore[arg-type]   # no answer
    assert not cluster.kv.reachable and not cluster.is_ready() and changes == [1]
    assert not cluster.cluster_state().kv_reachable


# ---------------------------------------------------------------- dtypes


def test_dtype_auto_takes_each_replicas_first_rank_choice(model_path: Path,
                                                          ctx: zmq.Context) -> None:
    cluster = make_membership(model_path, ctx, dtype="auto", tp_size=2)
    try:
        assert cluster.served_dtype() == "auto"                     # nothing placed yet

        def place(worker: str, preferred: str) -> str:
            return cluster.register(worker, 1, "cpu", 1, STEP_ADDRESS, "",
                                    preferred_dtype=preferred, cpu_level="avx2").dtype

        # Replica 0: its first rank prefers bfloat16; the second rank follows (ranks agree).
        assert place("a0", "bfloat16") == "bfloat16"
        assert place("a1", "float32") == "bfloat16"
        assert cluster.served_dtype() == "bfloat16"
        # Replica 1 forms on a float32 worker (an unknown preference counts as float32).
        assert place("b0", "float32") == "float32"
        assert place("b1", "") == "float32"
        assert cluster.served_dtype() == "bfloat16,float32"
        assert cluster.cluster_state().served_dtype == "bfloat16,float32"
        assert cluster.workers["b1"].cpu_level == "avx2"
        assert [r.dtype for r in cluster.replicas.values()] == ["bfloat16", "float32"]
    finally:
        cluster.shutdown()


def test_an_explicit_dtype_overrides_the_workers(model_path: Path, ctx: zmq.Context) -> None:
    cluster = make_membership(model_path, ctx, dtype="float32")
    try:
        placement = cluster.register("w", 1, "cpu", 1, STEP_ADDRESS, "",
                                     preferred_dtype="bfloat16")
        assert placement.dtype == "float32" and cluster.served_dtype() == "float32"
    finally:
        cluster.shutdown()


def test_a_worker_of_another_model_is_refused(cluster: Membership) -> None:
    with pytest.raises(RegistrationError, match="worker serves 'other'"):
        cluster.register("w", 1, "cpu", 1, STEP_ADDRESS, "other")
    assert cluster.register("w", 1, "cpu", 1, STEP_ADDRESS, cluster.model.name).replica_id == 0


# ---------------------------------------------------------------- one GPU, one worker

GPU_A = "GPU-6a2c4e1d-0000-4000-8000-00000000000a"
GPU_B = "GPU-6a2c4e1d-0000-4000-8000-00000000000b"


def test_a_second_worker_on_the_same_gpu_is_refused(model_path: Path, ctx: zmq.Context) -> None:
    cluster = make_membership(model_path, ctx, tp_size=2)
    try:
        def place(worker: str, uuid: str, epoch: int = 1) -> int:
            return cluster.register(worker, epoch, "cuda:0", 1, STEP_ADDRESS, "",
                                    device_uuid=uuid).replica_id

        assert place("w0", GPU_A) == 0
        # Same replica (it is still forming): NCCL cannot put two ranks on one GPU.
        with pytest.raises(RegistrationError) as refused:
            place("w1", GPU_A)
        message = str(refused.value)
        assert GPU_A in message and "w0" in message and "w1" in message
        assert "each rank of a replica needs its own GPU" in message
        assert "--device cuda:N" in message and "CUDA_VISIBLE_DEVICES" in message
        assert "w1" not in cluster.workers and cluster.replicas[0].ranks[1] is None
        # Another replica: refused too, the rule is cluster-wide.
        assert place("w1", GPU_B) == 0                    # replica 0 is now full
        with pytest.raises(RegistrationError, match=GPU_B):
            place("w2", GPU_B)
        assert set(cluster.replicas) == {0}             # no replica formed for w2
        # CPU workers report no uuid and may share a host.
        assert place("c0", "") == 1 and place("c1", "") == 1
    finally:
        cluster.shutdown()


def test_the_gpu_frees_when_its_worker_is_down_or_itself_again(cluster: Membership) -> None:
    first = cluster.register("w0", 1, "cuda:0", 1, STEP_ADDRESS, "", device_uuid=GPU_A)
    # The same worker restarted (newer epoch) on its own GPU replaces itself.
    again = cluster.register("w0", 2, "cuda:0", 1, STEP_ADDRESS, "", device_uuid=GPU_A)
    assert again.replica_id != first.replica_id
    assert cluster.replicas[first.replica_id].state == ReplicaState.DOWN
    # A refused worker changes nothing: w0's replica stays up.
    with pytest.raises(RegistrationError, match="already used by worker w0"):
        cluster.register("w1", 1, "cuda:0", 1, STEP_ADDRESS, "", device_uuid=GPU_A)
    assert cluster.replicas[again.replica_id].state == ReplicaState.FORMING
    # Once w0 is lost (its replica down), another worker may take the GPU.
    with cluster._lock:
        cluster._replica_lost_locked(again.replica_id, "test: w0 lost")
    taken = cluster.register("w1", 1, "cuda:0", 1, STEP_ADDRESS, "", device_uuid=GPU_A)
    assert cluster.workers["w1"].device_uuid == GPU_A
    assert cluster.replicas[taken.replica_id].state == ReplicaState.FORMING


# ---------------------------------------------------------------- KV capacity at start


def test_num_kv_blocks_past_a_workers_budget_is_refused(
        model_path: Path, ctx: zmq.Context, engines: FakeEngines,
        caplog: pytest.LogCaptureFixture) -> None:
    cluster = make_membership(model_path, ctx, engines, tp_size=2, num_kv_blocks=100)
    try:
        # Known before any replica exists: every replica will have exactly 100 blocks.
        assert cluster.max_kv_tokens() == 99 * 16
        assert cluster.cluster_state().max_kv_tokens == 99 * 16
        replica = form_replica(cluster, {"w0": 400, "w1": 60})
        # No engine core, no InitCache: the workers would over-allocate (or refuse it, taking
        # the replica down and registering again, over and over).
        assert replica.engine is None and replica.state == ReplicaState.REFUSED
        assert engines.started == []
        (message,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert "replica 0 not started" in message and "--num-kv-blocks 100" in message
        assert "worker w1 fits 60" in message and "w0" not in message
        assert "lower --num-kv-blocks to at most 60" in message
        assert cluster.heartbeat("w0", 1) and cluster.heartbeat("w1", 1)   # they wait, idle
        assert not cluster.ready_replicas() and cluster.served_dtype() == "auto"
    finally:
        cluster.shutdown()


def test_a_budget_under_two_blocks_is_refused(
        cluster: Membership, engines: FakeEngines, caplog: pytest.LogCaptureFixture) -> None:
    assert cluster.max_kv_tokens() is None
    replica = form_replica(cluster, {"w0": 1})
    assert replica.engine is None and replica.state == ReplicaState.REFUSED
    assert engines.started == []
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "worker w0 fits 1 KV block" in message and "at least 2" in message
    for flag in ("--kv-cache-memory-gib", "--gpu-memory-utilization", "--num-kv-blocks"):
        assert flag in message


def test_shutdown_stops_every_engine_core(model_path: Path, ctx: zmq.Context,
                                          engines: FakeEngines) -> None:
    cluster = make_membership(model_path, ctx, engines)
    form_replica(cluster, {"w0": 64})
    form_replica(cluster, {"w1": 64})
    for engine in engines.started:
        cluster.engine_report(report(engine))
    cluster.shutdown(timeout_s=1.0)
    assert sorted(replica_id for replica_id, _ in engines.stops) == [0, 1]
    assert all(e.exited() is not None for e in engines.started)


def test_a_killed_engine_cores_pool_is_dropped(cluster: Membership,
                                               engines: FakeEngines) -> None:
    """The monitor drops the pool of an engine core that died without dropping it: one
    that did not stop when told to and was killed is such a one."""
    engines.exit_on_stop = False
    form_replica(cluster, {"w0": 64})
    (engine,) = engines.started
    cluster.engine_report(report(engine))
    cluster.workers["w0"].last_heartbeat -= 1.0
    cluster._check_heartbeats()                        # told to stop; stuck
    assert engine.stop_sent_at is not None
    engine.stop_sent_at -= 60.0
    cluster.check_engines()                            # killed
    assert proc(engine).num_kills == 1
    probe = Probe()
    cluster._watch_kvcache(probe)  # type: ignore[arg-type]
    assert drops(probe) == [DropPool(replica_id=0)]
