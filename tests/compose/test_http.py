"""compose.yaml's `http` service (the OpenAI-compatible HTTP API), checked with Compose's own
`config` as tests/compose/test_config.py checks the rest: the same image, its own service (scalable
on a range of host ports), no member of the cluster (no token, no model), its command parsing
into the scheduler's public address, a liveness probe on /version; the scheduler's metrics
off port 8000. tests/compose/test_config.py runs it as a local process with the others and calls
`check_http_api`."""

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from services import cluster_token
from tests.compose.files import probe_args

HTTP_TARGET = 8000


def test_http_is_its_own_service_on_the_common_image(config: dict[str, Any]) -> None:  # noqa: F811
    services = config["services"]
    http = services["http"]
    assert http["command"] == ["python", "-m", "http_svc"]
    assert http["image"] == services["scheduler"]["image"] and http["init"] is True
    assert http["restart"] == "unless-stopped"
    (port,) = http["ports"]
    assert (port["target"], port["published"]) == (HTTP_TARGET, "8000-8009")  # --scale http=N
    # A client of the public API: no cluster secret, no model, no internal port.
    assert cluster_token.ENV not in http["environment"] and "volumes" not in http
    assert {dep: v["condition"] for dep, v in http["depends_on"].items()} == {
        "scheduler": "service_started"}
    assert probe_args(http) == ["--http", f"http://127.0.0.1:{HTTP_TARGET}/version"]


def test_metrics_moved_off_the_http_port(config: dict[str, Any]) -> None:  # noqa: F811
    scheduler = config["services"]["scheduler"]
    assert scheduler["environment"]["SPLITSERVE_METRICS_PORT"] == "50056"
    assert {(p["target"], p["published"]) for p in scheduler["ports"]} == {
        (50051, "50051"), (50056, "50056")}


def test_the_http_command_parses_into_the_schedulers_public_address(
        config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from http_svc.__main__ import parse_config
    from scheduler_svc.__main__ import parse_args as parse_scheduler

    services = config["services"]

    def argv_of(name: str) -> list[str]:
        for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
            monkeypatch.delenv(key)
        for key, value in services[name]["environment"].items():
            monkeypatch.setenv(key, str(value))
        return services[name]["command"][3:]

    server = parse_scheduler(argv_of("scheduler")).server
    http = parse_config(argv_of("http"))
    assert http.scheduler_address == f"scheduler:{server.port}"     # the public port
    assert (http.host, http.port) == ("0.0.0.0", HTTP_TARGET)
    assert http.port not in (server.metrics_port, server.port, server.control_port)


def check_http_api(base: str, timeout_s: float = 60) -> None:
    """The HTTP API at `base` turns ready and answers a chat completion."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:        # 503 (HTTPError is an OSError) or not listening yet
            pass
        assert time.monotonic() < deadline, f"{base}/health never answered 200"
        time.sleep(0.3)
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        reply = json.loads(r.read())
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] <= 8
