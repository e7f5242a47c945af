"""compose.yaml as a Docker Swarm stack file, on standard output:

    python scripts/swarm_stack.py | docker stack deploy --resolve-image never -c - splitserve
    docker service scale splitserve_worker=4

`docker stack deploy` reads the older compose v3 format: it refuses compose.yaml's
`depends_on` conditions and ignores `restart` and `build`. So the one compose file is first
resolved by Compose itself (`docker compose config`: variables, defaults, the cluster token
required as always), then each service keeps what a swarm uses, translated:

- `restart` becomes `deploy.restart_policy` (model-init: none, it runs once; the rest: any);
- `depends_on` goes: a swarm starts every service at once, and the services wait for each
  other themselves (a worker retries its registration for --register-timeout, then exits and
  is restarted; a scheduler whose model is not copied yet exits and is restarted);
- every service resolves by DNS to its task's own address (`endpoint_mode: dnsrr`), since each
  binds its internal listeners to the address its name resolves to (a virtual IP is nobody's);
  so the scheduler's published ports are host-mode ports of the node that runs it;
- a swarm puts a task's name in its DNS only once the task runs, so kvcache and the scheduler
  cannot bind their internal listeners to their own names at start as they do in compose:
  here they bind every interface of their container (its network namespace holds the stack's
  network and loopback only), and kvcache's healthcheck asks 127.0.0.1; a worker binds its
  own address (`auto` reads /etc/hosts, not the DNS);
- names of networks and volumes are left to the stack (STACK_default, STACK_models).

The image must be on every node already (or in a registry they pull from); a stack never
builds. The output holds the cluster token: pipe it, do not keep it in a file.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEPT = ("image", "command", "environment", "healthcheck", "init", "volumes",
        "stop_grace_period")
# Listeners bound by service name in compose.yaml, and what they bind in a swarm (above).
SWARM_BIND = {"SPLITSERVE_KV_HOST": "0.0.0.0", "SPLITSERVE_CONTROL_HOST": "0.0.0.0"}


def compose_config(files: list[str]) -> dict[str, Any]:
    args = ["docker", "compose", "--project-directory", str(ROOT)]
    for name in files:
        args += ["-f", name]
    done = subprocess.run([*args, "config", "--format", "json"], capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        raise SystemExit(f"docker compose config failed:\n{done.stderr}")
    return json.loads(done.stdout)


def stack_service(name: str, svc: dict[str, Any], ports: dict[int, int]) -> dict[str, Any]:
    out = {key: svc[key] for key in KEPT if key in svc}
    if "environment" in out:
        out["environment"] = {k: SWARM_BIND.get(k, v) for k, v in out["environment"].items()}
    if "healthcheck" in out:
        test = out["healthcheck"]["test"]
        out["healthcheck"] = {**out["healthcheck"], "test": [
            arg.replace(f"{name}:", "127.0.0.1:", 1) if arg.startswith(f"{name}:") else arg
            for arg in test]}
    once = svc.get("restart") in ("no", None) and name == "model-init"
    out["deploy"] = {"endpoint_mode": "dnsrr",
                     "restart_policy": {"condition": "none" if once else "any"}}
    if "volumes" in out:
        out["volumes"] = [{k: v for k, v in m.items() if k in ("type", "source", "target",
                                                                 "read_only")}
                          for m in out["volumes"]]
    if svc.get("ports"):
        out["ports"] = [{"target": int(p["target"]),
                         "published": ports.get(int(p["target"]), _first_port(p["published"])),
                         "protocol": p.get("protocol", "tcp"), "mode": "host"}
                        for p in svc["ports"]]
    return out


def _first_port(published: str | int) -> int:
    """A published port, or a range's first ("8000-8009", the http service's, so that
    `--scale http=N` finds ports under compose): a swarm's host-mode port is one number."""
    return int(str(published).split("-")[0])


def stack(config: dict[str, Any], ports: dict[int, int]) -> dict[str, Any]:
    return {
        "version": "3.8",
        "services": {name: stack_service(name, svc, ports)
                     for name, svc in config["services"].items()},
        "volumes": {name: {} for name in config.get("volumes", {})},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-f", "--file", action="append", dest="files",
                   help="compose file(s), as for docker compose (default: compose.yaml)")
    p.add_argument("--publish", action="append", default=[], metavar="TARGET=PUBLISHED",
                   help="publish a container port on another node port, e.g. 50051=51051")
    a = p.parse_args()
    ports = {int(t): int(pub) for t, pub in (item.split("=") for item in a.publish)}
    config = compose_config(a.files or [str(ROOT / "compose.yaml")])
    json.dump(stack(config, ports), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("COMPOSE_PROJECT_NAME", "splitserve")
    sys.exit(main())
