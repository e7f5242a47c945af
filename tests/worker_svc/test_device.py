"""Device selection and the KV budget's arithmetic, without a GPU (counts are passed in)."""

from pathlib import Path

import pytest
import torch

from worker_svc.device import DeviceError, device_label, device_uuid, dtype_for, resolve_device
from worker_svc.memory_budget import (
    GIB,
    ShardFootprint,
    cpu_budget,
    estimate_activation_bytes,
    gpu_budget,
    host_available_bytes,
    measure_kv_budget,
)


@pytest.mark.parametrize("spec, gpus, expected", [
    ("auto", 0, "cpu"), ("auto", 2, "cuda:0"), ("cpu", 4, "cpu"), ("CUDA", 1, "cuda:0"),
    ("cuda:1", 2, "cuda:1"), (" cuda:0 ", 1, "cuda:0"),
])
def test_resolve_device(spec: str, gpus: int, expected: str) -> None:
    assert device_label(resolve_device(spec, cuda_count=gpus)) == expected


@pytest.mark.parametrize("spec, gpus, message", [
    ("cuda", 0, "sees no CUDA GPU"), ("cuda:2", 2, r"only 2 GPU\(s\) are visible"),
    ("cuda:x", 1, "cuda:N"), ("tpu", 1, "expected auto, cpu, cuda or cuda:N"),
])
def test_resolve_device_refuses(spec: str, gpus: int, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        resolve_device(spec, cuda_count=gpus)


def test_dtypes_per_device() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert dtype_for(cpu, "bfloat16") is torch.bfloat16
    assert dtype_for(gpu, "float16") is torch.float16
    with pytest.raises(DeviceError, match="float16"):
        dtype_for(cpu, "float16")
    with pytest.raises(DeviceError):
        dtype_for(gpu, "int8")
    assert device_uuid(cpu) == ""


def test_gpu_budget_terms() -> None:
    # 80 GiB x 0.9 = 72; minus 1 of weights, 2 of activations, 0.5 other, 0.5 margin = 68.
    budget = gpu_budget("cuda:0", 80 * GIB, 0.9, 1 * GIB, 2 * GIB, GIB // 2, margin=GIB // 2)
    assert budget.budget == int(80 * GIB * 0.9) - 4 * GIB
    assert budget.num_blocks(GIB) == 68
    text = budget.describe()
    for term in ("80.00 total x 0.90", "weights 1.00", "peak activations 2.00", "other 0.50",
                 "margin 0.50", "KV budget 68.00 GiB"):
        assert term in text
    # Nothing left: zero blocks, never negative.
    assert gpu_budget("cuda:0", 8 * GIB, 0.1, GIB, GIB, 0).budget == 0
    with pytest.raises(ValueError, match="utilization"):
        gpu_budget("cuda:0", GIB, 1.5, 0, 0, 0)


def test_cpu_budget_takes_the_smaller_of_cap_and_what_is_free() -> None:
    assert cpu_budget(20 * GIB, GIB, GIB, cap=2 * GIB, margin=GIB).budget == 2 * GIB
    assert cpu_budget(3 * GIB, GIB, GIB, cap=2 * GIB, margin=GIB).budget == GIB
    assert cpu_budget(GIB, GIB, 2 * GIB, cap=None, margin=0).budget == 0


def test_host_available_bytes(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12345678 kB\n")
    assert host_available_bytes(str(meminfo)) == 12345678 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(OSError, match="MemAvailable"):
        host_available_bytes(str(meminfo))
    assert host_available_bytes() > 0


def test_activation_estimate_grows_with_tokens_and_rows() -> None:
    base = estimate_activation_bytes(2048, 256, 576, 960, 1536, 49152, 4)
    assert estimate_activation_bytes(4096, 256, 576, 960, 1536, 49152, 4) > base
    assert estimate_activation_bytes(2048, 0, 576, 960, 1536, 49152, 4) < base


def test_a_cpu_shards_budget_comes_from_its_footprint_alone() -> None:
    # No runner, no model: the footprint's numbers and the host's MemAvailable. The
    # profiling forward is a GPU's; a CPU estimates the same step instead.
    def profile(num_tokens: int, num_rows: int) -> int:
        raise AssertionError("a CPU budget runs no profiling forward")

    last = ShardFootprint(torch.device("cpu"), GIB, 576, 960, 1536, 49152, 4, samples=True)
    budget = measure_kv_budget(last, 2048, 256, 1 << 20, 0.9, profile)
    assert budget.budget == 1 << 20 and budget.weights == GIB
    assert budget.peak_activation == estimate_activation_bytes(2048, 256, 576, 960, 1536,
                                                               49152, 4)
    middle = ShardFootprint(torch.device("cpu"), GIB, 576, 960, 1536, 49152, 4, samples=False)
    assert measure_kv_budget(middle, 2048, 256, None, 0.9, profile).peak_activation == \
        estimate_activation_bytes(2048, 0, 576, 960, 1536, 49152, 4)
