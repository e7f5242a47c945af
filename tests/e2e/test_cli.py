"""`splitserve up` starts four processes (three sharing one cluster token, and the HTTP API),
`splitserve generate` and an HTTP client talk to them, Ctrl-C stops them all, and a worker
that cannot start is a clear error rather than a hang."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services import cluster_token
from tests.e2e.harness import free_ports, no_children_left, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def token_of(pid: int) -> str:
    """The cluster token in a running process's environment ("" if none)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    prefix = f"{cluster_token.ENV}=".encode()
    return next((e[len(prefix):].decode() for e in entries if e.startswith(prefix)), "")


def http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def member_env() -> dict[str, str]:
    """The environment of a service started by hand: a member of a cluster of its own."""
    return {**os.environ, "PYTHONPATH": str(ROOT), cluster_token.ENV: cluster_token.generate()}


def test_up_generate_and_ctrl_c(tmp_path: Path) -> None:
    port, http_port = free_ports(2)   # control takes port+1, the KV service port+2..+6
    env = {k: v for k, v in os.environ.items() if k != cluster_token.ENV}
    up = subprocess.Popen(cli("up", "--port", str(port), "--http-port", str(http_port),
                              "--kv-cache-memory-gib", "0.25", "--log-dir", str(tmp_path)),
                          cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = up.stderr.readline()  # type: ignore[union-attr]
            lines.append(line)
            if "ready on" in line or up.poll() is not None:
                break
        assert any("ready on" in x for x in lines), "".join(lines)
        children = child_pids(up.pid)
        assert len(children) == 4, f"expected kvcache, scheduler, a worker, http: {children}"
        tokens = {token_of(pid) for pid in children}     # one generated secret for all
        assert len(tokens) == 1 and len(tokens.pop()) == 64
        api = f"http://127.0.0.1:{http_port}/v1"
        assert up.stderr.readline().strip() == (  # type: ignore[union-attr]
            f"splitserve: OpenAI-compatible HTTP API on {api}")
        assert f"control on 127.0.0.1:{port + 1}" in "".join(lines)
        assert "token" not in "".join(lines).lower()      # a generated token is never shown

        out = subprocess.run(cli("generate", "What is the capital of France?", "--address",
                                 f"127.0.0.1:{port}", "--max-tokens", "12", "--json"),
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["finish_reason"] in ("stop", "length") and result["token_ids"]
        text = subprocess.run(cli("generate", "What is the capital of France?", "--address",
                                  f"127.0.0.1:{port}", "--max-tokens", "12"),
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "Paris" in text.stdout
        assert wait_for(lambda: http_ready(f"http://127.0.0.1:{http_port}/health"), 30)
        body = json.dumps({"messages": [{"role": "user", "content": "Capital of France?"}],
                           "max_tokens": 12, "temperature": 0}).encode()
        request = urllib.request.Request(f"{api}/chat/completions", body,
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["message"]["content"]

        up.send_signal(signal.SIGINT)               # what Ctrl-C sends
        assert up.wait(timeout=60) == 0
        assert "stopped (" in up.stderr.read()  # type: ignore[union-attr]
        assert wait_for(lambda: no_children_left(children), 10), "stray service processes"
    finally:
        if up.poll() is None:
            up.kill()


def test_worker_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    bad_model = tmp_path / "missing.gguf"
    port = free_ports(1)[0]
    worker = subprocess.run(
        [sys.executable, "-m", "worker_svc", "--scheduler", f"127.0.0.1:{port}",
         "--model", str(bad_model), "--register-timeout", "2"],
        cwd=ROOT, env=member_env(), capture_output=True, text=True, timeout=60)
    assert worker.returncode == 1
    assert "missing.gguf" in worker.stderr and "Traceback" not in worker.stderr


def test_tensor_parallel_wider_than_the_heads_is_refused_at_start() -> None:
    out = subprocess.run([sys.executable, "-m", "scheduler_svc", "--tp", "10"], cwd=ROOT,
                         env=member_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "only 9 attention heads" in out.stderr


def test_rank_missing_from_the_rendezvous_is_a_clear_error() -> None:
    """--tp 2 but only one worker starts: it registers as rank 0, waits for rank 1 at the
    torch.distributed rendezvous, and after its timeout exits 1 naming what is missing."""
    port, control_port = free_ports(2)
    env = member_env()
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "scheduler_svc", "--port", str(port), "--control-port",
         str(control_port), "--tp", "2", "--kvcache", "tcp://127.0.0.1:1",
         # off: the default port lies in the ephemeral range, where another connection's
         # TIME_WAIT (seen in a full-suite run) refuses the bind
         "--metrics-port", "-1"],
        cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    try:
        worker = subprocess.run(
            [sys.executable, "-m", "worker_svc", "--scheduler", f"127.0.0.1:{control_port}",
             "--register-timeout", "8"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert worker.returncode == 1, worker.stderr[-3000:]
        assert "not every rank of the replica joined" in worker.stderr, worker.stderr[-3000:]
        assert "rank 0 of 2" in worker.stderr and "Traceback" not in worker.stderr
    finally:
        scheduler.kill()
        scheduler.wait()


def test_serve_model_with_vllms_flags_and_a_config_file(tmp_path: Path) -> None:
    """`splitserve serve MODEL` as vLLM is spelled: the model positional, `-tp 1`, a YAML
    --config (flag names in any spelling: `dtype: float`, `no-enable-prefix-caching`), and the
    command line over the file (its --max-num-seqs 3 over the file's 5)."""
    import grpc

    from services.model_config import default_model_path
    from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc

    port = free_ports(1)[0]
    config = tmp_path / "serve.yaml"
    config.write_text(f"port: {port}\nhttp_port: -1\n--kv-cache-memory-gib: 0.25\n"
                      "dtype: float\nenable_prefix_caching: false\nmax-num-seqs: 5\n"
                      f"log-dir: {tmp_path}\n")
    serve = subprocess.Popen(cli("serve", str(default_model_path()), "-tp", "1", "--config",
                                 str(config), "--max-num-seqs", "3"),
                             cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = serve.stderr.readline()  # type: ignore[union-attr]
            lines.append(line)
            if "ready on" in line or serve.poll() is not None:
                break
        assert any("ready on" in x for x in lines), "".join(lines)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = generation_pb2_grpc.GenerationStub(channel).ServerInfo(
                generation_pb2.ServerInfoRequest(), timeout=10)
        assert info.replicas[0].dtype == "float32" and not info.prefix_caching
        assert info.max_num_seqs == 3
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
