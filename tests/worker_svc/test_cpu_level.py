"""CPU feature levels: detection from the CPU's flags and forcing a level. Every level's kernel
code compiling with every compiler, on any machine: test_kernel_build.py."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker_svc.config import WorkerConfig
from worker_svc.kernels import build, cpu
from worker_svc.kernels.cpu import CpuLevel, detect_level, select_level
from worker_svc.model.llama import Linear
from worker_svc.server import WorkerServer

AVX2_FLAGS = frozenset("fpu sse sse2 avx avx2 fma f16c bmi1 bmi2 abm movbe".split())
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
AMX_FLAGS = AVX512_FLAGS | {"avx512_bf16", "amx_tile", "amx_bf16"}


def test_detects_the_highest_complete_level() -> None:
    assert detect_level(frozenset({"fpu", "sse2", "avx"})) is CpuLevel.NONE
    assert detect_level(AVX2_FLAGS - {"fma"}) is CpuLevel.NONE
    assert detect_level(AVX2_FLAGS) is CpuLevel.AVX2
    assert detect_level(AVX2_FLAGS | {"avx512f"}) is CpuLevel.AVX2    # F alone is not v4
    assert detect_level(AVX512_FLAGS) is CpuLevel.AVX512
    assert detect_level(AVX512_FLAGS | {"avx512_bf16"}) is CpuLevel.AVX512_BF16
    # BF16 without the AVX-512 base is not a level (no such CPU, but no code assumes it).
    assert detect_level(AVX2_FLAGS | {"avx512_bf16"}) is CpuLevel.AVX2
    granted = lambda: None  # noqa: E731
    assert detect_level(AMX_FLAGS, granted) is CpuLevel.AMX
    assert detect_level(AMX_FLAGS - {"amx_bf16"}, granted) is CpuLevel.AVX512_BF16
    assert detect_level(AVX512_FLAGS | {"amx_tile", "amx_bf16"}, granted) is CpuLevel.AVX512


def test_amx_refused_by_linux_falls_back_a_level_and_says_why(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="worker_svc.kernels.cpu"):
        level = detect_level(AMX_FLAGS, lambda: "Linux refused the AMX tile state (test)")
    assert level is CpuLevel.AVX512_BF16
    assert "runs level avx512_bf16: Linux refused the AMX tile state (test)" in caplog.text


@pytest.mark.skipif(not {"amx_tile", "amx_bf16"} <= cpu.cpu_flags(), reason="no AMX on this CPU")
def test_this_process_gets_the_amx_tile_state() -> None:
    # Linux 5.16+ grants it on request; the machines with AMX we run on all do.
    assert cpu.request_amx() is None
    assert detect_level() is CpuLevel.AMX


def test_a_level_is_forced_down_never_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "detect_level", lambda flags=None: CpuLevel.AVX512)
    assert select_level("auto") is CpuLevel.AVX512
    assert select_level("AVX2") is CpuLevel.AVX2
    assert select_level("none") is CpuLevel.NONE
    with pytest.raises(ValueError, match="supports at most avx512"):
        select_level("avx512_bf16")
    with pytest.raises(ValueError, match="unknown CPU level 'sse9'"):
        select_level("sse9")


def test_native_bf16_from_the_bf16_level_up() -> None:
    assert [level.native_bf16 for level in CpuLevel] == [False, False, False, True, True]
    assert CpuLevel.AVX2.lanes == 8 and CpuLevel.AVX512.lanes == 16


@pytest.mark.parametrize("device, level, preferred", [
    ("cpu", CpuLevel.NONE, "float32"), ("cpu", CpuLevel.AVX2, "float32"),
    ("cpu", CpuLevel.AVX512, "float32"), ("cpu", CpuLevel.AVX512_BF16, "bfloat16"),
    ("cpu", CpuLevel.AMX, "bfloat16"),
    ("cuda", CpuLevel.AVX2, "bfloat16"), ("cuda:1", CpuLevel.NONE, "bfloat16"),
])
def test_the_dtype_a_worker_prefers(device: str, level: CpuLevel, preferred: str) -> None:
    # What --dtype auto becomes: the replica takes its first rank's preference (test_membership.py;
    # end to end in tests/e2e/test_cpu_levels.py at this CPU's level).
    config = WorkerConfig(
        scheduler_address="localhost:1", model_path="m.gguf", host="127.0.0.1",
        advertise_host="127.0.0.1", port=0, worker_id="w", epoch=1, device=torch.device(device),
        kv_cache_bytes=1 << 20, gpu_memory_utilization=0.9, num_threads=1, quant_kernels=True,
        cpu_level=level, register_timeout_s=1.0)
    assert WorkerServer(config).preferred_dtype == preferred


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the kernels fall back to torch")
def test_bf16_kernel_refuses_to_build_below_its_level(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
        build.compile_only("gemm_bf16.c", CpuLevel.AVX512, {}, tmp_path / "x.so")


def test_level_none_runs_bfloat16_in_torch() -> None:
    # No kernels, no oneDNN: torch's own bf16 matmul, which every CPU has.
    w = torch.randn(40, 24).bfloat16()
    linear = Linear([w])
    assert linear.gemm is None and linear.onednn is None and linear.weight is not None
    x = torch.randn(3, 24).bfloat16()
    torch.testing.assert_close(linear(x).float(), x.float() @ w.float().T, rtol=2 ** -7,
                               atol=1e-2)


_ONEDNN_PROBE = """
import sys
from worker_svc.__main__ import parse_args
parse_args(["--scheduler", "127.0.0.1:1", "--cpu-level", sys.argv[1]])
import torch
w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 64).bfloat16(), 16)
torch.ops.mkldnn._linear_pointwise(torch.randn(16, 64).bfloat16(), w, None, "none", [], "")
"""


@pytest.mark.skipif(detect_level() < CpuLevel.AVX512_BF16, reason="oneDNN's bf16 matmul "
                    "runs from level avx512 up; the cap matters where a higher level exists")
@pytest.mark.parametrize("level", ["avx512", "avx512_bf16", "amx"])
def test_a_worker_keeps_onednn_within_its_level(level: str) -> None:
    # oneDNN picks its own instruction set; a worker forced to a level caps it (in its own
    # process, before the first matmul), so the forced level really runs that level's code.
    if CpuLevel.parse(level) > detect_level():  # type: ignore[operator]
        pytest.skip(f"this CPU's best level is {detect_level().label}")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    done = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE, level], capture_output=True,
                          text=True, timeout=120, env={**env, "ONEDNN_VERBOSE": "1"})
    assert done.returncode == 0, done.stderr
    kernels = [line for line in done.stdout.splitlines() if ",exec,cpu," in line]
    assert kernels, done.stdout[-2000:]
    ran_amx = any("amx" in line for line in kernels)
    assert ran_amx == (level == "amx"), kernels
