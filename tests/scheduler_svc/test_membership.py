"""Membership: placement (contiguous stage ranges, uneven splits), heartbeat loss and epochs,
with fake engines (the e2e tests run the real ones); a replica whose workers cannot hold its
KV pool is refused before it starts. Routing is tests/scheduler_svc/test_router.py."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from scheduler_svc.config import SchedulerConfig, ServerConfig
from scheduler_svc.membership import Membership
from scheduler_svc.placement import RegistrationError, Replica, rendezvous_address, split_layers
from services.model_config import load_model_config
from tests.scheduler_svc.fakes import FakeEngine


@pytest.mark.parametrize("num_layers, pp, expected", [
    (30, 1, [(0, 30)]),
    (30, 2, [(0, 15), (15, 30)]),
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
    (30, 7, [(0, 5), (5, 10), (10, 14), (14, 18), (18, 22), (22, 26), (26, 30)]),
])
def test_split_layers(num_layers: int, pp: int, expected: list[tuple[int, int]]) -> None:
    ranges = split_layers(num_layers, pp)
    assert ranges == expected
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_rendezvous_on_rank0_host() -> None:
    address = rendezvous_address("tcp://10.1.2.3:5555")
    assert address.startswith("tcp://10.1.2.3:") and int(address.rsplit(":", 1)[1]) > 0


# ---------------------------------------------------------------- liveness


@pytest.fixture
def cluster(model_path: Path, tokenizer) -> Iterator[Membership]:  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    config = ServerConfig(model_path=str(model_path), model_name="",
                          kvcache_address="tcp://127.0.0.1:9", heartbeat_timeout_s=0.5)
    c = Membership(config, SchedulerConfig(block_size=16), load_model_config(model_path),
                   ctx, lambda outputs: None)
    c.kv_reachable = True
    yield c
    c.shutdown()
    ctx.destroy(linger=0)


def test_silent_worker_takes_its_replica_down(cluster: Membership) -> None:
    placement = cluster.register("w0", epoch=5, device="cpu", memory_bytes=1,
                                 step_address="tcp://127.0.0.1:9", model="")
    replica = cluster.replicas[placement.replica_id]
    engine = FakeEngine(placement.replica_id)
    replica.engine = engine  # type: ignore[assignment]
    replica.state = "ready"
    assert cluster.heartbeat("w0", 5)
    cluster._check_heartbeats()
    assert replica.state == "ready"
    cluster.workers["w0"].last_heartbeat -= 1.0       # past the 0.5 s timeout
    cluster._check_heartbeats()
    assert replica.state == "down" and "no heartbeat" in (engine.failed_over or "")
    assert not cluster.heartbeat("w0", 5)             # it must register again
    with pytest.raises(RegistrationError, match="not newer"):
        cluster.register("w0", epoch=5, device="cpu", memory_bytes=1,
                         step_address="tcp://127.0.0.1:9", model="")
    again = cluster.register("w0", epoch=6, device="cpu", memory_bytes=1,
                             step_address="tcp://127.0.0.1:9", model="")
    assert again.replica_id != placement.replica_id


def _cluster_with(model_path: Path, tokenizer, dtype: str, tp: int  # type: ignore[no-untyped-def]
                  ) -> Membership:
    config = ServerConfig(model_path=str(model_path), model_name="", dtype=dtype, tp_size=tp,
                          kvcache_address="tcp://127.0.0.1:9")
    return Membership(config, SchedulerConfig(block_size=16), load_model_config(model_path),
                      zmq.Context.instance(), lambda outputs: None)


def test_dtype_auto_takes_each_replicas_first_rank_choice(model_path: Path,
                                                          tokenizer) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster_with(model_path, tokenizer, "auto", tp=2)
    try:
        assert cluster.served_dtype() == "auto"                     # nothing placed yet

        def place(worker: str, preferred: str) -> str:
            return cluster.register(worker, 1, "cpu", 1, "tcp://127.0.0.1:9", "",
                                    preferred_dtype=preferred, cpu_level="avx2").dtype

        # Replica 0: its first rank prefers bfloat16; the second rank follows (ranks agree).
        assert place("a0", "bfloat16") == "bfloat16"
        assert place("a1", "float32") == "bfloat16"
        assert cluster.served_dtype() == "bfloat16"
        # Replica 1 forms on a float32 worker (an unknown preference counts as float32).
        assert place("b0", "float32") == "float32"
        assert place("b1", "") == "float32"
        assert cluster.served_dtype() == "bfloat16,float32"
        assert cluster.workers["b1"].cpu_level == "avx2"
        assert [r.dtype for r in cluster.replicas.values()] == ["bfloat16", "float32"]
    finally:
        cluster.shutdown()


def test_an_explicit_dtype_overrides_the_workers(model_path: Path,
                                                 tokenizer) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster_with(model_path, tokenizer, "float32", tp=1)
    try:
        placement = cluster.register("w", 1, "cpu", 1, "tcp://127.0.0.1:9", "",
                                     preferred_dtype="bfloat16")
        assert placement.dtype == "float32" and cluster.served_dtype() == "float32"
    finally:
        cluster.shutdown()


# ---------------------------------------------------------------- one GPU, one worker

GPU_A = "GPU-6a2c4e1d-0000-4000-8000-00000000000a"
GPU_B = "GPU-6a2c4e1d-0000-4000-8000-00000000000b"


def test_a_second_worker_on_the_same_gpu_is_refused(model_path: Path,
                                                    tokenizer) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster_with(model_path, tokenizer, "auto", tp=2)
    try:
        def place(worker: str, uuid: str, epoch: int = 1) -> int:
            return cluster.register(worker, epoch, "cuda:0", 1, "tcp://127.0.0.1:9", "",
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


def test_the_gpu_frees_when_its_worker_is_down_or_itself_again(model_path: Path,
                                                               tokenizer) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster_with(model_path, tokenizer, "auto", tp=1)
    try:
        first = cluster.register("w0", 1, "cuda:0", 1, "tcp://127.0.0.1:9", "",
                                 device_uuid=GPU_A)
        # The same worker restarted (newer epoch) on its own GPU replaces itself.
        again = cluster.register("w0", 2, "cuda:0", 1, "tcp://127.0.0.1:9", "",
                                 device_uuid=GPU_A)
        assert again.replica_id != first.replica_id
        assert cluster.replicas[first.replica_id].state == "down"
        # A refused worker changes nothing: w0's replica stays up.
        with pytest.raises(RegistrationError, match="already used by worker w0"):
            cluster.register("w1", 1, "cuda:0", 1, "tcp://127.0.0.1:9", "", device_uuid=GPU_A)
        assert cluster.replicas[again.replica_id].state == "forming"
        # Once w0 is lost (its replica down), another worker may take the GPU.
        cluster._replica_lost_locked(again.replica_id, "test: w0 lost")
        taken = cluster.register("w1", 1, "cuda:0", 1, "tcp://127.0.0.1:9", "",
                                 device_uuid=GPU_A)
        assert cluster.workers["w1"].device_uuid == GPU_A
        assert cluster.replicas[taken.replica_id].state == "forming"
    finally:
        cluster.shutdown()


# ---------------------------------------------------------------- KV capacity at start


def _sized_cluster(model_path: Path, tokenizer, tp: int,  # type: ignore[no-untyped-def]
                   num_kv_blocks: int | None) -> Membership:
    config = ServerConfig(model_path=str(model_path), model_name="", tp_size=tp,
                          num_kv_blocks=num_kv_blocks, kvcache_address="tcp://127.0.0.1:9")
    return Membership(config, SchedulerConfig(block_size=16), load_model_config(model_path),
                      zmq.Context.instance(), lambda outputs: None)


def _report(cluster: Membership, blocks: dict[str, int]) -> Replica:
    for worker_id in blocks:
        cluster.register(worker_id, 1, "cpu", 1, "tcp://127.0.0.1:9", "")
    for worker_id, num_blocks in blocks.items():
        cluster.report_capacity(worker_id, 1, num_blocks)
    return cluster.replicas[cluster.workers[worker_id].replica_id]


def test_num_kv_blocks_past_a_workers_budget_is_refused(
        model_path: Path, tokenizer, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    cluster = _sized_cluster(model_path, tokenizer, tp=2, num_kv_blocks=100)
    try:
        # Known before any replica exists: every replica will have exactly 100 blocks.
        assert cluster.max_kv_tokens() == 99 * 16
        replica = _report(cluster, {"w0": 400, "w1": 60})
        # No engine, no InitCache: the workers would over-allocate (or refuse it, taking
        # the replica down and registering again, over and over).
        assert replica.engine is None and replica.state == "refused"
        (message,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert "replica 0 not started" in message and "--num-kv-blocks 100" in message
        assert "worker w1 fits 60" in message and "w0" not in message
        assert "lower --num-kv-blocks to at most 60" in message
        assert cluster.heartbeat("w0", 1) and cluster.heartbeat("w1", 1)   # they wait, idle
        assert not cluster.ready_replicas() and cluster.served_dtype() == "auto"
    finally:
        cluster.shutdown()


def test_a_budget_under_two_blocks_is_refused(
        model_path: Path, tokenizer, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    cluster = _sized_cluster(model_path, tokenizer, tp=1, num_kv_blocks=None)
    try:
        assert cluster.max_kv_tokens() is None
        replica = _report(cluster, {"w0": 1})
        assert replica.engine is None and replica.state == "refused"
        (message,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert "worker w0 fits 1 KV block" in message and "at least 2" in message
        for flag in ("--kv-cache-memory-gib", "--gpu-memory-utilization", "--num-kv-blocks"):
            assert flag in message
    finally:
        cluster.shutdown()


def test_down_replicas_close_their_sockets_and_are_not_kept_forever(cluster: Membership) -> None:
    # 40 one-rank replicas come and go (a stream of registrations, or churn): each down
    # replica's output socket closes at once, and only the last MAX_DOWN_REPLICAS stay listed.
    from scheduler_svc.membership import MAX_DOWN_REPLICAS

    sockets = []
    for i in range(40):
        placement = cluster.register(f"w{i}", epoch=1, device="cpu", memory_bytes=1,
                                     step_address="tcp://127.0.0.1:9", model="")
        replica = cluster.replicas[placement.replica_id]
        sockets.append(replica.outputs.socket)
        with cluster._lock:
            cluster._replica_lost_locked(placement.replica_id, "gone")
    assert all(sock.closed for sock in sockets)
    down = [r for r in cluster.replicas.values() if r.state == "down"]
    assert len(down) == len(cluster.replicas) == MAX_DOWN_REPLICAS
    assert sorted(cluster.workers) == sorted(f"w{i}" for i in range(40 - MAX_DOWN_REPLICAS, 40))
