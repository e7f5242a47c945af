"""scripts/gpu-check --dry-run: the whole GPU run on a CPU, with stand-ins for the GPU commands
(pytest collects the same files, the bench parses the same arguments), into the same output
folder under the same limits, so that a GPU run is never spent finding a typo: at most 8
files, each under 16 MiB, no subfolder deeper than two, names the device tool returns, and a
summary naming every phase. A phase that fails does not stop the ones after it. Phase 4 (the
fp8 KV cache) on its own, and the flag its bench passes the scheduler."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from services.flags import FlagParser
from services.service_flags import add_scheduler_flags

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["env", "models", "kernels", "logits", "services", "bench-smollm2", "bench-llama-1b",
          "profile", "bench-interval4", "logits-fp8", "bench-kv-fp8"]
PHASE_4 = ["env", "models", "kernels-fp8", "logits-fp8", "bench-kv-bf16", "bench-kv-fp8"]
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def dry_run(out: Path, phase: str = "all", **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env}
    return subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--dry-run", "--phase", phase],
                          capture_output=True, text=True, env=environ, cwd=ROOT, timeout=120)


def phase_statuses(summary: str) -> dict[str, str]:
    statuses = {}
    for line in summary.splitlines():
        fields = line.split()
        if fields and fields[0] in PHASES + PHASE_4:
            statuses[fields[0]] = fields[1]
    return statuses


def test_the_dry_run_fills_the_output_folder_within_the_limits(tmp_path: Path) -> None:
    done = dry_run(tmp_path / "out", SPLITSERVE_GPU_CHECK_DRY_FAIL="kernels")
    assert done.returncode == 1, done.stdout + done.stderr      # the injected failure
    out = tmp_path / "out"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for path in files:
        relative = path.relative_to(out)
        assert len(relative.parts) <= 3, relative              # OUT/a/b/file at most
        assert all(NAME.match(part) for part in relative.parts), relative
        assert path.stat().st_size < 16 << 20, relative
    assert {p.name for p in files} >= {"gpu-check.log", "summary.txt", "junit.xml",
                                       "bench.json", "cluster-logs.tar.gz"}
    summary = (out / "summary.txt").read_text()
    assert len(summary.splitlines()) <= 40
    statuses = phase_statuses(summary)
    assert list(statuses) == PHASES, summary
    assert statuses["kernels"] == "FAIL"
    assert all(status == "DRY" for name, status in statuses.items() if name != "kernels"), \
        summary
    assert "not passed: kernels" in summary
    assert summary in done.stdout                               # what the tool's tail shows


def test_phase_4_runs_the_fp8_checks_alone(tmp_path: Path) -> None:
    """--phase 4: the fp8 kernel tests and logits check collected, both benches' arguments
    parsed, the fp8 one with a scheduler flag the scheduler's own parser takes."""
    out = tmp_path / "out"
    done = dry_run(out, phase="4")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text()
    assert phase_statuses(summary) == {name: "DRY" for name in PHASE_4}, summary
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8
    log = (out / "gpu-check.log").read_text()
    assert "test_triton_fp8.py" in log and "test_logits_fp8.py" in log
    bf16 = json.loads((out / "bench-kv-bf16.json").read_text())["args"]
    fp8 = json.loads((out / "bench-kv-fp8.json").read_text())["args"]
    assert bf16["scheduler_arg"] == [] and bf16["shapes"] == fp8["shapes"] == "smollm2"
    assert bf16["dtype"] == fp8["dtype"] == "bfloat16"
    scheduler = add_scheduler_flags(FlagParser(prog="scheduler")).parse_args(
        fp8["scheduler_arg"])
    assert scheduler.kv_cache_dtype == "fp8"
    assert "bench-kv-fp8: bench: dry run" in summary
