"""WorkerControl as a thin adapter over membership: Register's proto request reaches it (the
GPU uuid included) and the answer carries the scheduler's step limits; a refusal becomes
FAILED_PRECONDITION with membership's message; capacity reports start the replica's engine
core; heartbeats say whether the worker is still known. Driven directly, no server or
network."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import zmq

from scheduler_svc.cluster.membership import Membership
from scheduler_svc.cluster.servicer import WorkerControlServicer
from scheduler_svc.config import ServerConfig
from scheduler_svc.engine.config import SchedulerConfig
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import control_pb2
from tests.scheduler_svc.cluster.fakes import FakeEngines
from tests.scheduler_svc.grpc_context import Aborted, FakeContext

GPU = "GPU-0b7f3c2a-0000-4000-8000-000000000001"


@pytest.fixture
def engines() -> FakeEngines:
    return FakeEngines()


@pytest.fixture
def servicer(model_path: Path, ctx: zmq.Context,
             engines: FakeEngines) -> Iterator[WorkerControlServicer]:
    config = ServerConfig(model_path=str(model_path), model_name="", tp_size=2,
                          kvcache_address="tcp://127.0.0.1:9")
    sched = SchedulerConfig(block_size=16, max_num_seqs=48, max_num_batched_tokens=512,
                            chunked_prefill=False, max_model_len=4096)
    cluster = Membership(config, sched, load_model_config(model_path), ctx, engines)
    yield WorkerControlServicer(cluster)
    cluster.shutdown()


def register(servicer: WorkerControlServicer, worker_id: str,
             device_uuid: str, epoch: int = 1) -> control_pb2.RegisterResponse:
    request = control_pb2.RegisterRequest(
        worker_id=worker_id, epoch=epoch, device="cuda:0", memory_bytes=1,
        step_address="tcp://127.0.0.1:9", device_uuid=device_uuid)
    return asyncio.run(servicer.Register(request, FakeContext()))  # type: ignore[arg-type]


def report_capacity(servicer: WorkerControlServicer, worker_id: str, epoch: int,
                    num_kv_blocks: int) -> None:
    request = control_pb2.CapacityReport(worker_id=worker_id, epoch=epoch,
                                         num_kv_blocks=num_kv_blocks)
    asyncio.run(servicer.ReportCapacity(request, FakeContext()))  # type: ignore[arg-type]


def test_register_answers_the_step_limits(servicer: WorkerControlServicer) -> None:
    placement = register(servicer, "w0", GPU)
    assert (placement.tp_size, placement.tp_rank, placement.block_size) == (2, 0, 16)
    assert placement.max_num_seqs == 48
    # Chunked prefill is off: a whole prompt up to the context length can be one step.
    assert placement.max_num_batched_tokens == 4096
    assert servicer.membership.workers["w0"].device_uuid == GPU


def test_a_gpu_held_by_another_worker_is_a_failed_precondition(
        servicer: WorkerControlServicer) -> None:
    register(servicer, "w0", GPU)
    with pytest.raises(Aborted) as refused:
        register(servicer, "w1", GPU)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert GPU in refused.value.details and "w0" in refused.value.details


def test_an_epoch_from_the_far_future_is_refused(servicer: WorkerControlServicer) -> None:
    # A newer epoch supersedes a worker's older one: 2**63 - 1 would lock the real worker out.
    register(servicer, "w0", GPU)
    with pytest.raises(Aborted) as refused:
        register(servicer, "w0", GPU, epoch=2**63 - 1)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than a day ahead" in refused.value.details
    assert servicer.membership.workers["w0"].epoch == 1


def test_capacity_reports_start_the_engine_core_and_heartbeats_say_who_is_known(
        servicer: WorkerControlServicer, engines: FakeEngines) -> None:
    register(servicer, "w0", "")
    register(servicer, "w1", "")
    report_capacity(servicer, "w0", 1, 80)
    report_capacity(servicer, "w1", 1, 70)
    (engine,) = engines.started
    assert engine.config.num_kv_blocks == 70
    with pytest.raises(Aborted) as refused:
        report_capacity(servicer, "w2", 1, 70)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown worker w2" in refused.value.details

    def heartbeat(worker_id: str, epoch: int) -> bool:
        request = control_pb2.HeartbeatRequest(worker_id=worker_id, epoch=epoch)
        return asyncio.run(servicer.Heartbeat(request, FakeContext())).known  # type: ignore[arg-type]

    assert heartbeat("w0", 1) and not heartbeat("w0", 2) and not heartbeat("w9", 1)
