"""compose.yaml on a real engine, step by step, checked through the published ports only.

    python scripts/compose_scenario.py [--project NAME] [--keep]

Run by scripts/compose-check, which provides the engine, Compose v2 (`docker compose`) and the
built image `splitserve:cpu`. Steps, each timed; the first that fails ends the run with every
container's logs and `down -v`:

 reference   the greedy answers of a local cluster (services.launcher) on this machine
 up          `up -d --wait --scale worker=2` (float32, one thread per worker, published on
             127.0.0.1 at free ports through a check-only override)
 replicas    ServerInfo: two ready replicas
 greedy      every prompt answered token-exact against the reference
 metrics     /metrics on the published metrics port, two replicas up
 listeners   every process listens on its container's own address only, but for the
             ports its container publishes
 kill        one worker container's process SIGKILLed under a load of requests: the engine
             restarts the container, the worker registers again (a new epoch) and two replicas
             serve; not one request of the load fails
 scale-up    `up --scale worker=3` under load: a third replica forms and takes requests, and no
             running container restarted
 scale-down  `up --scale worker=1` under load: two workers stopped and removed, one replica
             left, not one request failed
 drain       `stop scheduler` with four streams mid-answer: each finishes whole and exact, the
             scheduler exits 0
 down        `down -v`: no container, network or volume of the project left
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from cluster_client import (
    PROMPTS,
    CheckFailed,
    RequestLoad,
    Timer,
    check_greedy,
    deployment_env,
    describe,
    fetch_metrics,
    free_port,
    generate,
    load_references,
    server_info,
    wait_replica_steps,
    wait_replicas,
    wait_until,
)

from services.rpc.splitserve.v1 import generation_pb2_grpc
from tests.e2e.listeners import WILDCARDS, descendants, listening

ROOT = Path(__file__).resolve().parents[1]
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"


def docker(*args: str, timeout_s: float = 120, check: bool = True,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True,
                            timeout=timeout_s, env=env)
    if check and result.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args)} exited {result.returncode}:\n"
                          f"{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return result


class Project:
    """One compose project of compose.yaml plus a check-only override, driven by the CLI."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.api_port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        override = workdir / "compose.check.yaml"
        # The published ports on the loopback only, at ports free here; !override replaces
        # compose.yaml's list instead of adding to it.
        override.write_text(
            "services:\n  scheduler:\n    ports: !override\n"
            f'      - "127.0.0.1:{self.api_port}:50051"\n'
            f'      - "127.0.0.1:{self.metrics_port}:50056"\n'
            "  http:\n    ports: !override\n"
            f'      - "127.0.0.1:{self.http_port}:8000"\n')
        self.files = ["-f", str(ROOT / "compose.yaml"), "-f", str(override)]
        self.env = deployment_env()
        self.address = f"127.0.0.1:{self.api_port}"

    def compose(self, *args: str, timeout_s: float = 300,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        return docker("compose", "-p", self.name, "--project-directory", str(ROOT),
                      *self.files, *args, timeout_s=timeout_s, check=check, env=self.env)

    def containers(self, service: str | None = None) -> list[dict]:
        """`docker inspect` of the project's containers (running or not), by number."""
        labels = ["--filter", f"label={PROJECT_LABEL}={self.name}"]
        if service:
            labels += ["--filter", f"label={SERVICE_LABEL}={service}"]
        ids = docker("ps", "-aq", *labels).stdout.split()
        if not ids:
            return []
        found = json.loads(docker("inspect", *ids).stdout)
        return sorted(found, key=lambda c: (c["Config"]["Labels"].get(SERVICE_LABEL, ""),
                                            int(c["Config"]["Labels"].get(NUMBER_LABEL, 0))))

    def logs(self) -> str:
        parts = []
        for c in self.containers():
            out = docker("logs", "--tail", "150", c["Id"], check=False)
            parts.append(f"----- {c['Name'].lstrip('/')} ({c['State']['Status']}, exit "
                         f"{c['State']['ExitCode']}, restarts {c['RestartCount']})\n"
                         f"{out.stdout}{out.stderr}")
        return "\n".join(parts) or "(no containers)"

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label={PROJECT_LABEL}={self.name}"
        return {kind: found for kind, args in (
                    ("containers", ("ps", "-aq", "--filter", label)),
                    ("volumes", ("volume", "ls", "-q", "--filter", label)),
                    ("networks", ("network", "ls", "-q", "--filter", label)))
                if (found := docker(*args).stdout.split())}


def worker_process(container: dict) -> int:
    """Host PID of the worker's Python process: the child of the container's init (tini)."""
    init_pid = container["State"]["Pid"]
    children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    if not children:
        raise CheckFailed(f"{container['Name']}: its init {init_pid} has no child")
    return int(children[0])


def restarts(containers: list[dict]) -> dict[str, tuple[str, int]]:
    """Name -> (start time, restart count): what a restart would change."""
    return {c["Name"]: (c["State"]["StartedAt"], c["RestartCount"]) for c in containers}


class Scenario:
    def __init__(self, project: Project, references_file: Path | None) -> None:
        self.project = project
        self.references_file = references_file
        self.timer = Timer()
        self.step = self.timer.step
        self.references: dict[str, list[int]] = {}
        self.channel = grpc.insecure_channel(project.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def load(self, num_clients: int = 2) -> RequestLoad:
        return RequestLoad(self.project.address, self.references, num_clients)

    def run(self) -> None:
        p = self.project
        with self.step("reference"):
            self.references = load_references(self.references_file)
        with self.step("up"):
            # A clean slate: what an interrupted earlier run may have left of this project.
            p.compose("down", "-v", "--remove-orphans", timeout_s=120, check=False)
            p.compose("up", "-d", "--wait", "--scale", "worker=2", timeout_s=420)
        with self.step("replicas"):
            wait_replicas(self.stub, 2, timeout_s=120)
        with self.step("greedy"):
            check_greedy(self.stub, self.references, "the compose cluster")
        with self.step("metrics"):
            text = fetch_metrics(f"http://127.0.0.1:{p.metrics_port}/metrics")
            if not re.search(r"^splitserve:replicas_up(\{[^}]*\})? 2\.0$", text, re.M):
                raise CheckFailed("/metrics does not say splitserve:replicas_up 2.0:\n" +
                                  "\n".join(line for line in text.splitlines()
                                            if line.startswith("splitserve:replicas")))
        with self.step("listeners"):
            self.check_listeners()
        with self.step("kill"):
            self.kill_a_worker()
        with self.step("scale-up"):
            self.scale_up()
        with self.step("scale-down"):
            self.scale_down()
        with self.step("drain"):
            self.drain()
        self.channel.close()
        with self.step("down"):
            p.compose("down", "-v", "--remove-orphans", timeout_s=120)
            if left := p.leftovers():
                raise CheckFailed(f"down -v left {left}")

    def check_listeners(self) -> None:
        """Every process of every container listens on its container's own address, except on
        the container ports it publishes (every interface, as published ports are); nothing
        else on a wildcard, nothing on the container's loopback."""
        found = []
        for c in self.project.containers():
            if not c["State"]["Running"]:
                continue
            own = {n["IPAddress"] for n in c["NetworkSettings"]["Networks"].values()}
            published = {int(key.split("/")[0])
                         for key in (c["HostConfig"].get("PortBindings") or {})}
            sockets = sorted({a for pid in descendants([c["State"]["Pid"]])
                              for a in listening(pid)})
            for host, port in sockets:
                if host not in own and not (host in WILDCARDS and port in published):
                    raise CheckFailed(f"{c['Name']} listens on {host}:{port}; its own address "
                                      f"is {own}, it publishes {sorted(published)} (all its "
                                      f"listeners: {sockets})")
            found.append(f"{c['Name'].lstrip('/')} {len(sockets)}")
        print(f"compose-check:   listeners on own addresses only: {', '.join(found)}",
              flush=True)

    def kill_a_worker(self) -> None:
        p = self.project
        victim = p.containers("worker")[0]
        before = {(w.worker_id, w.epoch) for r in server_info(self.stub).replicas
                  for w in r.workers}
        with self.load() as load:
            load.wait_answers(2, timeout_s=60)
            migrations = server_info(self.stub).num_migrations
            pid = worker_process(victim)
            os.kill(pid, 9)
            print(f"compose-check:   SIGKILL to {victim['Name']}'s worker (host pid {pid})",
                  flush=True)
            wait_until(f"{victim['Name']} restarted by the engine", lambda: True if (
                c := p.containers("worker")[0])["RestartCount"] > victim["RestartCount"]
                and c["State"]["Running"] else None, timeout_s=60)

            def rejoined(info) -> bool:
                now = {(w.worker_id, w.epoch) for r in info.replicas if r.state == "ready"
                       for w in r.workers}
                return bool(now - before)          # a new incarnation serves

            info = wait_replicas(self.stub, 2, timeout_s=180, also=rejoined)
            print(f"compose-check:   {describe(info)}", flush=True)
            load.wait_answers(4, timeout_s=60)
        result = load.check(min_answered=6)
        moved = server_info(self.stub).num_migrations - migrations
        print(f"compose-check:   {result.num_answered} requests answered under the kill "
              f"({moved} moved off the lost replica), none failed", flush=True)

    def scale_up(self) -> None:
        p = self.project
        running = restarts([*p.containers("scheduler"), *p.containers("kvcache"),
                            *p.containers("worker")])
        old_ids = {r.replica_id for r in server_info(self.stub).replicas}
        # Four clients on three replicas: the router sends a request to the replica with the
        # fewest live ones, so the new replica gets work only while the others are busy.
        with self.load(num_clients=4) as load:
            load.wait_answers(2, timeout_s=60)
            p.compose("up", "-d", "--wait", "--no-recreate", "--scale", "worker=3",
                      timeout_s=300)
            info = wait_replicas(self.stub, 3, timeout_s=180)
            (new,) = [r.replica_id for r in info.replicas
                      if r.state == "ready" and r.replica_id not in old_ids]
            wait_replica_steps(self.stub, new)
            load.wait_answers(4, timeout_s=60)
        load.check(min_answered=6)
        now = restarts([*p.containers("scheduler"), *p.containers("kvcache"),
                        *p.containers("worker")])
        changed = {name: (was, now.get(name)) for name, was in running.items()
                   if now.get(name) != was}
        if changed:
            raise CheckFailed(f"scaling up restarted running containers: {changed}")
        print(f"compose-check:   {describe(server_info(self.stub))}", flush=True)

    def scale_down(self) -> None:
        p = self.project
        migrations = server_info(self.stub).num_migrations
        with self.load(num_clients=4) as load:
            load.wait_answers(2, timeout_s=60)
            p.compose("up", "-d", "--wait", "--no-recreate", "--scale", "worker=1",
                      timeout_s=300)
            workers = p.containers("worker")
            if len(workers) != 1:
                raise CheckFailed(f"{len(workers)} worker containers after --scale worker=1")
            wait_replicas(self.stub, 1, timeout_s=60)
            load.wait_answers(4, timeout_s=60)
        result = load.check(min_answered=6)
        moved = server_info(self.stub).num_migrations - migrations
        print(f"compose-check:   {result.num_answered} requests answered while two workers "
              f"left ({moved} moved off their replicas), none failed", flush=True)

    def drain(self) -> None:
        """Four streams mid-answer when the scheduler gets SIGTERM: each ends whole."""
        p = self.project
        started = threading.Semaphore(0)
        answers: dict[str, list[int] | Exception] = {}
        progress = dict.fromkeys(PROMPTS, 0)

        def stream(prompt: str) -> None:
            with grpc.insecure_channel(p.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                first = [True]

                def on_token(num_tokens: int) -> None:
                    progress[prompt] = num_tokens
                    if first[0]:
                        first[0] = False
                        started.release()
                try:
                    answers[prompt] = generate(stub, prompt, len(self.references[prompt]),
                                               on_token=on_token)
                except (grpc.RpcError, CheckFailed) as exc:
                    answers[prompt] = exc
                    started.release()

        threads = [threading.Thread(target=stream, args=(prompt,)) for prompt in PROMPTS]
        for thread in threads:
            thread.start()
        for _ in threads:
            if not started.acquire(timeout=120):
                raise CheckFailed("the drain's streams did not start")
        at_stop = dict(progress)
        if all(n == len(self.references[prompt]) for prompt, n in at_stop.items()):
            raise CheckFailed("every stream had finished before the stop: nothing to drain")
        t0 = time.monotonic()
        p.compose("stop", "scheduler", timeout_s=120)
        stopped_s = time.monotonic() - t0
        for thread in threads:
            thread.join(timeout=120)
        bad = {prompt: answer for prompt, answer in answers.items()
               if answer != self.references[prompt]}
        if bad or len(answers) != len(PROMPTS):
            raise CheckFailed(f"streams cut or changed by the scheduler's stop: {bad}")
        (scheduler,) = p.containers("scheduler")
        if scheduler["State"]["Running"] or scheduler["State"]["ExitCode"] != 0:
            raise CheckFailed(f"scheduler after stop: {scheduler['State']}")
        print(f"compose-check:   4 streams at {sorted(at_stop.values())} of "
              f"{len(self.references[PROMPTS[0]])} tokens when stopped finished whole; the "
              f"scheduler drained and exited 0 in {stopped_s:.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", default="splitserve-check")
    parser.add_argument("--keep", action="store_true", help="leave the project up on failure")
    parser.add_argument("--references", type=Path,
                        help="the local cluster's answers (JSON), made when missing")
    args = parser.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"{args.project}-{os.getpid()}"
    workdir.mkdir(parents=True)
    project = Project(args.project, workdir)
    scenario = Scenario(project, args.references)
    try:
        scenario.run()
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"compose-check: CHECK FAILED: {exc}", flush=True)
        print("compose-check: logs of every container of the project:", flush=True)
        print(project.logs(), flush=True)
        if not args.keep:
            project.compose("down", "-v", "--remove-orphans", timeout_s=120, check=False)
        return 1
    finally:
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()
        scenario.timer.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
