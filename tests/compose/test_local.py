"""compose.yaml's services as local processes (way (c) of tests/compose/test_config.py): the same
commands, environments and healthchecks, with service names rewritten to 127.0.0.1 and ports
to free ones, start in compose's dependency order, turn healthy, serve a Generate and the HTTP
API, and stop with exit code 0. What this does not cover: the image build and a real `docker
compose up` (scripts/compose-check does)."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from services import cluster_token
from services.model_config import DEFAULT_MODEL_FILE, default_model_path
from tests.compose.files import (
    READINESS_SERVICE,
    ROOT,
    Service,
)


class LocalCompose:
    """compose.yaml's services as local processes: service names become 127.0.0.1, every port
    a free one, /models a scratch directory, the worker's heartbeat file a scratch file."""

    HOST = re.compile(r"(?<![\w.-])(kvcache|scheduler|0\.0\.0\.0)(?=:|$)")

    def __init__(self, config: dict[str, Any], tmp: Path) -> None:
        from tests.e2e.harness import free_ports

        self.services: dict[str, Service] = config["services"]
        self.tmp = tmp
        (tmp / "models").mkdir()
        (tmp / "logs").mkdir()
        ports = sorted({port for svc in self.services.values() for port in self._ports(svc)})
        self.port_map = dict(zip(ports, map(str, free_ports(len(ports)))))
        self.health_file = self.services["worker"]["environment"]["SPLITSERVE_HEALTH_FILE"]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.log_files: list[BinaryIO] = []

    @staticmethod
    def _ports(svc: Service) -> set[str]:
        env = svc.get("environment", {})
        found = {str(v) for k, v in env.items() if k.endswith("_PORT")}
        texts = [*map(str, env.values()), *svc.get("healthcheck", {}).get("test", [])]
        return found | {m for text in texts for m in re.findall(r":(\d+)$", text)}

    def rewrite(self, text: str) -> str:
        text = self.HOST.sub("127.0.0.1", text)
        text = re.sub(r"(?<![\w.])\d+(?![\w.])",
                      lambda m: self.port_map.get(m.group(0), m.group(0)), text)
        text = text.replace(self.health_file, str(self.tmp / "worker.alive"))
        return text.replace("/models", str(self.tmp / "models"))

    def argv(self, args: list[str]) -> list[str]:
        args = [self.rewrite(a) for a in args]
        return [sys.executable, *args[1:]] if args[0] == "python" else args

    def env(self, name: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
        if name is not None:
            env.update({k: str(v) if k == cluster_token.ENV else self.rewrite(str(v))
                        for k, v in self.services[name].get("environment", {}).items()})
        if name == "worker":
            env["SPLITSERVE_KV_CACHE_MEMORY_GIB"] = "0.25"
            env["SPLITSERVE_WORKER_HOST"] = "127.0.0.1"      # `auto`: this host's own address
        env["PYTHONPATH"] = str(ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def probe(self, name: str, *extra: str) -> list[str]:
        return self.argv(self.services[name]["healthcheck"]["test"][1:]) + list(extra)

    def start(self, name: str) -> None:
        log = open(self.tmp / "logs" / f"{name}.log", "wb")  # noqa: SIM115 - closed by stop()
        self.log_files.append(log)
        self.procs[name] = subprocess.Popen(
            self.argv(self.services[name]["command"]), env=self.env(name), cwd=self.tmp,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def run_once(self, name: str, timeout_s: float) -> None:
        result = subprocess.run(self.argv(self.services[name]["command"]), env=self.env(name),
                                cwd=self.tmp, capture_output=True, text=True, timeout=timeout_s)
        assert result.returncode == 0, f"{name} failed:\n{result.stdout}{result.stderr}"

    def wait_healthy(self, probe: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if dead := {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}:
                raise AssertionError(f"exited early: {dead}\n{self.logs()}")
            result = subprocess.run(probe, env=self.env(None), capture_output=True,
                                    text=True, timeout=30)
            if result.returncode == 0:
                return
            last = (result.stdout + result.stderr).strip()
            time.sleep(0.3)
        raise AssertionError(f"{probe[3:]} still unhealthy: {last}\n{self.logs()}")

    def up(self, timeout_s: float) -> None:
        """Starts every service after its dependencies, honouring each depends_on condition."""
        conditions = {"service_started", "service_healthy", "service_completed_successfully"}
        one_shot = {dep for svc in self.services.values()
                    for dep, cond in svc.get("depends_on", {}).items()
                    if cond["condition"] == "service_completed_successfully"}
        done: set[str] = set()
        healthy: set[str] = set()
        while len(done) < len(self.services):
            ready = [n for n, svc in self.services.items() if n not in done
                     and set(svc.get("depends_on", {})) <= done]
            assert ready, f"dependency cycle among {set(self.services) - done}"
            for name in sorted(ready):
                for dep, cond in self.services[name].get("depends_on", {}).items():
                    assert cond["condition"] in conditions, cond
                    if cond["condition"] == "service_healthy" and dep not in healthy:
                        self.wait_healthy(self.probe(dep), timeout_s)
                        healthy.add(dep)
                if name in one_shot:
                    self.run_once(name, timeout_s)
                else:
                    self.start(name)
                done.add(name)

    def stop(self, grace_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM workers first (as `docker compose down` does), then their dependencies."""
        for name in ("http", "worker", "scheduler", "kvcache"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for log in self.log_files:
            log.close()
        return {name: proc.returncode for name, proc in self.procs.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.tmp / "logs").glob("*.log")))


@pytest.fixture
def local_compose(config: dict[str, Any], tmp_path: Path) -> Iterator[LocalCompose]:
    local = LocalCompose(config, tmp_path)
    try:
        yield local
    finally:
        local.stop()


@pytest.mark.e2e
def test_compose_services_as_local_processes(local_compose: LocalCompose) -> None:
    import grpc

    from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc
    from tests.compose.test_http import check_http_api
    from tests.e2e.harness import stream_tokens

    local = local_compose
    local.up(timeout_s=60)
    seeded = local.tmp / "models" / DEFAULT_MODEL_FILE
    assert seeded.read_bytes() == default_model_path().read_bytes()  # model-init's copy
    local.wait_healthy(local.probe("scheduler", "--service", READINESS_SERVICE), timeout_s=60)
    local.wait_healthy(local.probe("worker"), timeout_s=15)   # heartbeat file is fresh

    address = local.probe("scheduler")[-1]
    with grpc.insecure_channel(address) as channel:
        request = generation_pb2.GenerateRequest(
            text="The capital of France is",
            sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True))
        ids, text, last = stream_tokens(generation_pb2_grpc.GenerationStub(channel), request,
                                        timeout=60)
    assert len(ids) == 8 and text, (ids, text)
    metrics_port = local.env("scheduler")["SPLITSERVE_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        assert r.status == 200 and b"# TYPE" in r.read()
    local.wait_healthy(local.probe("http"), timeout_s=60)           # the HTTP API's liveness
    check_http_api(f"http://127.0.0.1:{local.env('http')['SPLITSERVE_HTTP_PORT']}")

    codes = local.stop()
    assert codes == {"kvcache": 0, "scheduler": 0, "worker": 0, "http": 0}, \
        f"{codes}\n{local.logs()}"
