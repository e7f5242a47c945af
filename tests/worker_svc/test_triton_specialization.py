"""The paged-attention launcher compiles one kernel whatever the block table's width: an eager
step's table is as wide as its longest request, so a width Triton specialized on (1, a multiple
of 16) would compile a new variant mid-serving. Likewise whatever the sliding window (0, 1, a
multiple of 16 or not). On a CPU this asks Triton's own argument binder
(the one `JITFunction.run` keys its compile cache on) for an sm_90 target, in a process without
TRITON_INTERPRET; on a GPU (`gpu`) it counts the compiled kernels."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (1, 7, 16, 33)
WINDOWS = (0, 1, 16, 23, 4096)

# Prints the kernel's cache key for each width, then each window, one line each (or SKIP: why).
_PROBE = f"""
import torch
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(GPUTarget("cuda", 90, 32))
except Exception as exc:
    print("SKIP:", type(exc).__name__, exc)
    raise SystemExit(0)
from worker_svc.triton_kernels import paged_attention as pa
fn = pa._paged_attention_kernel
binder = create_function_from_signature(fn.signature, fn.params, backend)
q, cache = torch.empty(4, 9, 64), torch.empty(2, 10, 16, 3, 64)
index = torch.zeros(4, dtype=torch.int64)
for width, window in [(w, 0) for w in {WIDTHS}] + [(7, w) for w in {WINDOWS}]:
    table = torch.zeros(4, width, dtype=torch.int64)
    _, spec, _ = binder(q, q.stride(0), cache[0], cache[1], table, width, index, index,
                        window, torch.empty(4, 576), 0.125, NUM_KV_HEADS=3, BLOCK_SIZE=16,
                        HEAD_DIM=64, GROUP=3, GROUP_PAD=4, TILE=32)
    print(repr(spec))
"""


def test_the_block_table_width_and_window_do_not_change_the_compile_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    if lines and lines[0].startswith("SKIP:"):
        pytest.skip(f"this Triton's binder is not reachable: {lines[0]}")
    assert len(lines) == len(WIDTHS) + len(WINDOWS)
    names = [f"width {w}" for w in WIDTHS] + [f"window {w}" for w in WINDOWS]
    assert len(set(lines)) == 1, "\n".join(f"{n}: {k}" for n, k in zip(names, lines))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_compiled_kernel_for_every_width_and_window_on_the_gpu() -> None:
    from worker_svc.triton_kernels import paged_attention as pa

    fn = pa._paged_attention_kernel
    q = torch.randn(4, 9, 64, device="cuda")
    cache = torch.randn(2, 40, 16, 3, 64, device="cuda")
    rows = torch.arange(4, device="cuda")

    def num_compiled() -> int:
        return sum(len(caches[0]) for caches in fn.device_caches.values())

    pa.paged_attention(q, cache, torch.ones(4, 1, dtype=torch.int64, device="cuda"), rows,
                       torch.ones(4, dtype=torch.int64, device="cuda"), 0.125)
    before = num_compiled()
    for width in WIDTHS:
        table = torch.randint(1, 40, (4, width), device="cuda")
        lens = torch.full((4,), width * 16, dtype=torch.int64, device="cuda")
        pa.paged_attention(q, cache, table, rows, lens, 0.125)
        for window in WINDOWS:
            pa.paged_attention(q, cache, table, rows, lens, 0.125, window)
    torch.cuda.synchronize()
    assert num_compiled() == before
