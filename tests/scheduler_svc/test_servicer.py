"""WorkerControl's Register as a thin adapter: the proto request reaches the cluster (the GPU
uuid included), the answer carries the scheduler's step limits, and a refusal becomes
FAILED_PRECONDITION with the cluster's message; a request a replica refuses is
INVALID_ARGUMENT. Driven directly, with no server or network."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import zmq

from scheduler_svc.config import SchedulerConfig, ServerConfig
from scheduler_svc.frontend import PreparedRequest
from scheduler_svc.membership import Membership
from scheduler_svc.request import RequestOutput, SamplingParams
from scheduler_svc.servicer import GenerationServicer, WorkerControlServicer
from scheduler_svc.validation import InvalidRequest
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import control_pb2, generation_pb2

GPU = "GPU-0b7f3c2a-0000-4000-8000-000000000001"


class Aborted(Exception):
    """What the fake context raises where grpc.aio's abort would end the call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class FakeContext:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


@pytest.fixture
def servicer(model_path: Path, tokenizer) -> Iterator[WorkerControlServicer]:  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    config = ServerConfig(model_path=str(model_path), model_name="", tp_size=2,
                          kvcache_address="tcp://127.0.0.1:9")
    sched = SchedulerConfig(block_size=16, max_num_seqs=48, max_num_batched_tokens=512,
                            chunked_prefill=False, max_model_len=4096)
    cluster = Membership(config, sched, load_model_config(model_path), ctx, lambda out: None)
    yield WorkerControlServicer(cluster)
    cluster.shutdown()
    ctx.destroy(linger=0)


def register(servicer: WorkerControlServicer, worker_id: str,
             device_uuid: str, epoch: int = 1) -> control_pb2.RegisterResponse:
    request = control_pb2.RegisterRequest(
        worker_id=worker_id, epoch=epoch, device="cuda:0", memory_bytes=1,
        step_address="tcp://127.0.0.1:9", device_uuid=device_uuid)
    return asyncio.run(servicer.Register(request, FakeContext()))  # type: ignore[arg-type]


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


class RefusingFrontend:
    """Takes the request, then a replica refuses it as it is taken in."""

    async def prepare(self, *_: object) -> PreparedRequest:
        return PreparedRequest("r", [1, 2], SamplingParams())

    async def generate(self, prepared: PreparedRequest, time_remaining: float | None,
                       whole: bool = False) -> AsyncIterator[RequestOutput]:
        raise InvalidRequest("the pool holds 16 tokens")
        yield  # an async generator, like Frontend.generate


class StreamContext(FakeContext):
    def time_remaining(self) -> float | None:
        return None


def test_a_refusal_after_dispatch_is_invalid_argument(model_path: Path) -> None:
    servicer = GenerationServicer(RefusingFrontend(),  # type: ignore[arg-type]
                                  load_model_config(model_path))
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2]))
    with pytest.raises(Aborted) as refused:
        asyncio.run(servicer.GenerateOnce(request, StreamContext()))  # type: ignore[arg-type]
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the pool holds 16 tokens" in refused.value.details
