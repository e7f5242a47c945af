"""The worker's answer to InitCache (`Placer.init_cache`): allocate within its measured budget,
or refuse with a WorkerFailure and keep serving (a forged or careless InitCache used to kill
the process)."""

import pytest
import torch

from services.rpc.splitserve.v1 import control_pb2
from services.wire import CacheReady, InitCache, WorkerFailure
from worker_svc.config import WorkerConfig
from worker_svc.kernels.cpu import CpuLevel
from worker_svc.placement import Placer


class FakeRunner:
    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.fail = fail

    def init_cache(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append((num_blocks, block_size, max_num_seqs))


class Outputs:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)


@pytest.fixture
def placer() -> Placer:
    return Placer(WorkerConfig(
        scheduler_address="localhost:1", model_path="m.gguf", host="127.0.0.1",
        advertise_host="127.0.0.1", port=0, worker_id="w", epoch=1,
        device=torch.device("cpu"), kv_cache_bytes=1 << 20, gpu_memory_utilization=0.9,
        num_threads=1, quant_kernels=True, cpu_level=CpuLevel.NONE, register_timeout_s=1.0))


PLACEMENT = control_pb2.RegisterResponse(block_size=16, max_num_seqs=8)


def test_init_cache_within_the_budget(placer: Placer) -> None:
    runner, outputs = FakeRunner(), Outputs()
    placer.init_cache(runner, InitCache(num_blocks=50, block_size=16), 100,  # type: ignore[arg-type]
                      outputs, PLACEMENT)  # type: ignore[arg-type]
    assert runner.calls == [(50, 16, 8)]
    assert outputs.sent == [CacheReady(worker_id="w", num_blocks=50)]


@pytest.mark.parametrize("message, fail, reason", [
    (InitCache(num_blocks=2**31 - 1, block_size=16), None, "asks for 2147483647 KV blocks"),
    (InitCache(num_blocks=1, block_size=16), None, "holds 2..100"),
    (InitCache(num_blocks=50, block_size=32), None, "block size 32"),
    (InitCache(num_blocks=50, block_size=16), RuntimeError("CUDA out of memory"),
     "out of memory"),
])
def test_init_cache_refused(placer: Placer, message: InitCache,
                            fail: Exception | None, reason: str) -> None:
    runner, outputs = FakeRunner(fail), Outputs()
    placer.init_cache(runner, message, 100, outputs, PLACEMENT)  # type: ignore[arg-type]
    assert runner.calls == []
    (failure,) = outputs.sent
    assert isinstance(failure, WorkerFailure) and reason in failure.message
