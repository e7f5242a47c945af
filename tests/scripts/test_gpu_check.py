"""scripts/gpu-check --dry-run: the whole GPU run on a CPU, with stand-ins for the GPU commands
(pytest collects the same files, the bench parses the same arguments), into the same output
folder under the same limits, so that a GPU run is never spent finding a typo: at most 8
files, each under 16 MiB, no subfolder deeper than two, names the device tool returns, and a
summary naming every phase. A phase that fails does not stop the ones after it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["env", "models", "kernels", "logits", "services", "bench-smollm2", "bench-llama-1b",
          "profile", "bench-interval4"]
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def dry_run(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env}
    return subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--dry-run", "--phase", "all"],
                          capture_output=True, text=True, env=environ, cwd=ROOT, timeout=120)


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
    statuses = {}
    for line in summary.splitlines():
        fields = line.split()
        if fields and fields[0] in PHASES:
            statuses[fields[0]] = fields[1]
    assert list(statuses) == PHASES, summary
    assert statuses["kernels"] == "FAIL"
    assert all(status == "DRY" for name, status in statuses.items() if name != "kernels"), \
        summary
    assert "not passed: kernels" in summary
    assert summary in done.stdout                               # what the tool's tail shows
