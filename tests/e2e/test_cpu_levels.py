"""Every CPU level end to end: workers forced to a level (`--cpu-level`, as on a CPU that has
no more), with `--dtype auto` and with bfloat16, against HF transformers in float32.

On a CPU without AVX-512 a bfloat16 worker once crashed at start (oneDNN's bf16 matmul needs
AVX-512); now bfloat16 runs at every level, natively only at avx512_bf16."""

from pathlib import Path

import pytest

from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.harness import assert_matches_reference, greedy_request, run_cluster, stream_tokens
from tests.worker_svc.common import level_params
from worker_svc.kernels.cpu import CpuLevel, detect_level

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 4
MAX_TOKENS = 12


def test_dtype_auto_at_this_cpus_level(tmp_path: Path, prompts: list[list[int]],
                                       oracle) -> None:  # type: ignore[no-untyped-def]
    # At this CPU's own level (the mapping for every level: test_cpu_level.py; a forced level
    # end to end: test_bfloat16_at_every_level below).
    level = detect_level()
    expected = "bfloat16" if level.native_bf16 else "float32"
    with run_cluster(tmp_path, dtype="auto") as c:
        info = c.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
        assert info.dtype == expected
        server = c.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)
        (replica,) = server.replicas
        assert replica.dtype == expected and replica.workers[0].cpu_level == level.label
        log = (tmp_path / "worker0.log").read_text()
        assert f"kernel level {level.label}" in log and f"dtype {expected}" in log
        if expected == "float32":      # token for token against HF in float32
            for i, prompt in enumerate(prompts[:NUM_PROMPTS]):
                ids, _, _ = stream_tokens(c.stub, greedy_request(prompt, MAX_TOKENS))
                ref, margins = oracle.greedy(prompt, MAX_TOKENS)
                assert_matches_reference(ids, ref, margins, f"{level.label} prompt {i}")


@pytest.mark.parametrize("level", level_params(with_none=True))
def test_bfloat16_at_every_level(tmp_path: Path, level: CpuLevel,
                                 prompts: list[list[int]], oracle) -> None:  # type: ignore[no-untyped-def]
    with run_cluster(tmp_path, dtype="bfloat16",
                     worker_args=["--cpu-level", level.label]) as c:
        server = c.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)
        assert server.replicas[0].dtype == "bfloat16"
        assert server.replicas[0].workers[0].cpu_level == level.label
        assert f"kernel level {level.label}" in (tmp_path / "worker0.log").read_text()
        agreed = 0
        for prompt in prompts[:NUM_PROMPTS]:
            ids, _, final = stream_tokens(c.stub, greedy_request(prompt, MAX_TOKENS))
            assert len(ids) == MAX_TOKENS and final.finish_reason == "length"
            ref, margins = oracle.greedy(prompt, MAX_TOKENS)
            # bfloat16 rounds every weight and activation: it follows the float32 reference
            # while the reference's choice is clear, and may part from it after a close one.
            for mine, theirs, margin in zip(ids, ref, margins):
                if margin < 1.0:
                    break
                assert mine == theirs
                agreed += 1
        assert agreed >= NUM_PROMPTS, "too few clear steps to compare"


def test_a_worker_whose_kernels_do_not_build_reports_what_it_runs(
        tmp_path: Path, prompts: list[list[int]]) -> None:
    # A C compiler that builds nothing (as one too old for the kernels' code): the worker says
    # so in a warning and runs, and reports, level none (torch), whatever its CPU has.
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'broken-cc: error: cannot compile' >&2\nexit 1\n")
    compiler.chmod(0o755)
    env = {"CC": str(compiler), "SPLITSERVE_KERNEL_DIR": str(tmp_path / "kernels")}
    with run_cluster(tmp_path, env=env) as c:
        server = c.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)
        assert server.replicas[0].workers[0].cpu_level == "none"
        log = (tmp_path / "worker0.log").read_text()
        assert "WARNING" in log and "broken-cc: error: cannot compile" in log, log[-3000:]
        assert "running level none (torch for every kernel) instead" in log
        assert "kernel level none" in log
        ids, _, final = stream_tokens(c.stub, greedy_request(prompts[0], MAX_TOKENS))
        assert len(ids) == MAX_TOKENS and final.finish_reason == "length"
