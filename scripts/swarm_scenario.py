"""compose.yaml as a Docker Swarm stack on a one-node swarm, checked through the published
ports only.

    python scripts/swarm_scenario.py [--stack NAME] [--references FILE]

Run by scripts/compose-check after the compose scenario, with the same engine and image.
Steps, each timed; the first that fails ends the run with every service's tasks and logs:

 swarm       a one-node swarm (`swarm init`) unless the engine is in one already
 deploy      `docker stack deploy` of scripts/swarm_stack.py's stack file (compose.yaml resolved
             by Compose, float32, one thread per worker, ports published at free ones)
 replicas    one worker, one ready replica
 greedy      every prompt answered token-exact against the local reference
 scale       `docker service scale STACK_worker=2` under a load of requests: a second replica
             forms and takes requests, not one request fails
 remove      `docker stack rm` and the stack's volume: no container, network or volume left;
             the swarm is left again if this run made it
"""

import argparse
import subprocess
import sys
from pathlib import Path

import grpc
from cluster_client import (
    CheckFailed,
    RequestLoad,
    Timer,
    check_greedy,
    deployment_env,
    describe,
    free_port,
    load_references,
    server_info,
    wait_replica_steps,
    wait_replicas,
    wait_until,
)
from compose_scenario import docker

from services.rpc.splitserve.v1 import generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
STACK_LABEL = "com.docker.stack.namespace"


def advertise_address() -> str:
    """This machine's address on its default route (what `swarm init` advertises)."""
    route = subprocess.run(["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True,
                           text=True).stdout.split()
    return route[route.index("src") + 1] if "src" in route else "127.0.0.1"


class Stack:
    def __init__(self, name: str) -> None:
        self.name = name
        self.api_port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.api_port}"
        self.env = deployment_env()
        self.made_swarm = False

    def join_swarm(self) -> None:
        state = docker("info", "--format", "{{.Swarm.LocalNodeState}}").stdout.strip()
        if state == "active":
            print("compose-check:   the engine is in a swarm already; using it", flush=True)
            return
        docker("swarm", "init", "--advertise-addr", advertise_address())
        self.made_swarm = True

    def deploy(self) -> None:
        stack_file = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "swarm_stack.py"), "--publish",
             f"50051={self.api_port}", "--publish", f"50056={self.metrics_port}",
             "--publish", f"8000={self.http_port}"],
            capture_output=True, text=True, env=self.env, timeout=120)
        if stack_file.returncode != 0:
            raise CheckFailed(f"swarm_stack.py failed:\n{stack_file.stderr}")
        done = subprocess.run(["docker", "stack", "deploy", "--resolve-image", "never", "-c",
                               "-", self.name], input=stack_file.stdout, capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise CheckFailed(f"docker stack deploy failed:\n{done.stdout}{done.stderr}")

    def logs(self) -> str:
        parts = [docker("stack", "ps", "--no-trunc", self.name, check=False).stdout]
        services = docker("stack", "services", "--format", "{{.Name}}", self.name,
                          check=False).stdout.split()
        for service in services:
            out = docker("service", "logs", "--tail", "150", "--no-task-ids", service,
                         check=False, timeout_s=60)
            parts.append(f"----- {service}\n{out.stdout}{out.stderr}")
        return "\n".join(parts)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label={STACK_LABEL}={self.name}"
        return {kind: found for kind, args in (
                    ("containers", ("ps", "-aq", "--filter", label)),
                    ("volumes", ("volume", "ls", "-q", "--filter", label)),
                    ("networks", ("network", "ls", "-q", "--filter", label)))
                if (found := docker(*args).stdout.split())}

    def remove(self) -> None:
        docker("stack", "rm", self.name, check=False)
        wait_until("the stack's containers gone", lambda: True if not docker(
            "ps", "-aq", "--filter", f"label={STACK_LABEL}={self.name}").stdout.split()
            else None, timeout_s=90)
        # A stack's volumes outlive `stack rm` (data is kept); this check keeps nothing.
        volumes = docker("volume", "ls", "-q", "--filter",
                         f"label={STACK_LABEL}={self.name}").stdout.split()
        if volumes:
            wait_until("the stack's volumes removed", lambda: True if docker(
                "volume", "rm", *volumes, check=False).returncode == 0 else None, timeout_s=60)
        wait_until("the stack's network removed", lambda: True if not docker(
            "network", "ls", "-q", "--filter", f"label={STACK_LABEL}={self.name}",
        ).stdout.split() else None, timeout_s=60)

    def leave_swarm(self) -> None:
        if self.made_swarm:
            docker("swarm", "leave", "--force", check=False)
            # `swarm init` made this bridge for the node's swarm traffic; it outlives `leave`.
            docker("network", "rm", "docker_gwbridge", check=False)
            self.made_swarm = False


def run(stack: Stack, references: dict[str, list[int]], step) -> None:  # type: ignore[no-untyped-def]
    with step("swarm"):
        stack.join_swarm()
    with step("deploy"):
        if stack.leftovers():                 # an interrupted earlier run's stack
            stack.remove()
        stack.deploy()
    channel = grpc.insecure_channel(stack.address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    with step("replicas"):
        wait_replicas(stub, 1, timeout_s=240)
    with step("greedy"):
        check_greedy(stub, references, "the stack")
    with step("scale"):
        (first,) = [r.replica_id for r in server_info(stub).replicas if r.state == "ready"]
        with RequestLoad(stack.address, references, num_clients=3) as load:
            load.wait_answers(2, timeout_s=60)
            docker("service", "scale", "--detach", f"{stack.name}_worker=2")
            info = wait_replicas(stub, 2, timeout_s=240)
            (new,) = [r.replica_id for r in info.replicas
                      if r.state == "ready" and r.replica_id != first]
            wait_replica_steps(stub, new)
            load.wait_answers(4, timeout_s=60)
        result = load.check(min_answered=6)
        print(f"compose-check:   {describe(server_info(stub))}; {result.num_answered} "
              "requests answered while scaling, none failed", flush=True)
    channel.close()
    with step("remove"):
        stack.remove()
        stack.leave_swarm()
        if left := stack.leftovers():
            raise CheckFailed(f"the stack left {left}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="splitserve-check")
    parser.add_argument("--references", type=Path,
                        help="the local cluster's answers (JSON), made when missing")
    args = parser.parse_args()
    timer = Timer()
    stack = Stack(args.stack)
    try:
        with timer.step("reference"):
            references = load_references(args.references)
        run(stack, references, timer.step)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"compose-check: CHECK FAILED: {exc}", flush=True)
        print("compose-check: the stack's tasks and every service's logs:", flush=True)
        print(stack.logs(), flush=True)
        try:
            stack.remove()
        except CheckFailed as left:
            print(f"compose-check: {left}", flush=True)
        return 1
    finally:
        stack.leave_swarm()
        timer.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
