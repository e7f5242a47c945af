"""compose.yaml's first version: every service's command and environment parse with that
service's own flag parser into the addresses the others expect. (No Docker engine runs on the
development machines; `docker compose config` and a real `up` come with issue 4.)"""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_and_modules(compose: dict) -> None:  # type: ignore[type-arg]
    services = compose["services"]
    assert set(services) == {"kvcache", "scheduler", "worker"}
    for name, svc in services.items():
        assert svc["command"][:2] == ["python", "-m"], name
        assert (ROOT / svc["command"][2] / "__main__.py").is_file(), name


def test_commands_parse_into_matching_addresses(compose: dict, monkeypatch) -> None:  # type: ignore[type-arg,no-untyped-def]
    from kvcache_svc.__main__ import parse_config
    from scheduler_svc.__main__ import parse_args as parse_scheduler
    from worker_svc.__main__ import parse_args as parse_worker

    services = compose["services"]

    def env_of(name: str) -> None:
        for key in [k for k in __import__("os").environ if k.startswith("SPLITSERVE_")]:
            monkeypatch.delenv(key)
        for key, value in services[name].get("environment", {}).items():
            monkeypatch.setenv(key, str(value))

    env_of("kvcache")
    kv = parse_config(services["kvcache"]["command"][3:])
    env_of("scheduler")
    server, _, _ = parse_scheduler(services["scheduler"]["command"][3:])
    env_of("worker")
    worker = parse_worker(services["worker"]["command"][3:])

    assert server.kvcache_address == f"tcp://kvcache:{kv.plan_port}"
    assert worker.scheduler_address == f"scheduler:{server.port}"
    assert server.advertise_host == "scheduler"
    assert worker.host == "0.0.0.0" and worker.advertise_host not in ("0.0.0.0", "")
    assert f"{server.port}:{server.port}" in services["scheduler"]["ports"]
