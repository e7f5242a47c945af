"""scripts/compose-check's own decisions, with stand-ins for the engine on PATH (no Docker is
needed or touched): a machine where no engine can start says SKIPPED and exits 0, never
PASSED; a failed step exits 1 and names it; a step that fails on the network is tried again,
up to three times, and one that fails otherwise is not.

The real run (an engine, the image, the cluster) is the script itself, which .ci/run runs after
the suite; its times are in the README."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compose-check"

# A docker CLI whose engine answers; `compose build` fails as BUILD_OUTPUT says, and every call
# is logged. The base image is "present", PyTorch's index "answers" (curl), so the build is the
# first step that does anything.
FAKE_DOCKER = """#!/bin/bash
echo "$*" >> "$CALLS"
case "$1 $2" in
  "compose build"|"compose -p") if [[ "$*" == *" build "* ]]; then
      echo "$BUILD_OUTPUT"; exit 1; fi ;;
esac
exit 0
"""


def run(tmp_path: Path, stubs: dict[str, str], **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in stubs.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
               "CALLS": str(tmp_path / "calls"), "SPLITSERVE_CHECK_RETRY_S": "0", **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=ROOT,
                          env=environ, timeout=120)


def test_no_engine_can_start_is_skipped_not_passed(tmp_path: Path) -> None:
    done = run(tmp_path, {
        "docker": "#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2; exit 1\n",
        "dockerd": "#!/bin/sh\necho 'failed to start daemon: operation not permitted' >&2\n"
                   "exit 1\n",
    })
    assert done.returncode == 0, done.stdout + done.stderr
    skipped = [line for line in done.stdout.splitlines() if "SKIPPED" in line]
    assert len(skipped) == 1 and "no container engine" in skipped[0], done.stdout
    assert "not a pass" in skipped[0]
    assert "PASSED" not in done.stdout and "FAILED" not in done.stdout
    if os.getuid() == 0:           # it tried, and shows why the engine did not come up
        assert "operation not permitted" in done.stdout


def test_a_failed_build_fails_the_check_without_a_retry(tmp_path: Path) -> None:
    done = run(tmp_path, {"docker": FAKE_DOCKER, "curl": "#!/bin/sh\nexit 0\n"},
               BUILD_OUTPUT="error: gcc: internal compiler error")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "compose-check: FAILED: building the image" in done.stdout
    assert "internal compiler error" in done.stdout            # the build's own words
    builds = [c for c in (tmp_path / "calls").read_text().splitlines() if " build " in c]
    assert len(builds) == 1, builds
    assert "PASSED" not in done.stdout and "SKIPPED" not in done.stdout


def test_a_network_error_is_tried_three_times(tmp_path: Path) -> None:
    done = run(tmp_path, {"docker": FAKE_DOCKER, "curl": "#!/bin/sh\nexit 0\n"},
               BUILD_OUTPUT="pip: Temporary failure in name resolution")
    assert done.returncode == 1, done.stdout + done.stderr
    builds = [c for c in (tmp_path / "calls").read_text().splitlines() if " build " in c]
    assert len(builds) == 3, builds
    assert done.stdout.count("network error on try") == 2
    assert "compose-check: FAILED: building the image" in done.stdout
