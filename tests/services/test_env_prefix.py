"""One `SPLITSERVE_*` prefix everywhere: every environment variable the services read by name
is a SPLITSERVE_ one (flag fallbacks get the prefix from services.flags), but for the few that
belong to other tools (CUDA's device list, the C compiler, Triton's interpreter switch)."""

import re
from pathlib import Path

from services.flags import ENV_PREFIX

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("services", "scheduler_svc", "worker_svc", "kvcache_svc", "http_svc")
# Read by name but not ours: their owners' names are what their users set.
OTHER_TOOLS = {"CUDA_VISIBLE_DEVICES", "CC", "TRITON_INTERPRET"}
# os.environ.get("X"), os.environ["X"], os.getenv("X"), environ.get("X", ...), and a module's
# ENV = "X" constant naming the variable it reads.
READ = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\()\s*["']([A-Za-z0-9_]+)["']"""
                  r"""|^\s*[A-Z_]*ENV\s*=\s*["']([A-Z0-9_]+)["']""", re.MULTILINE)


def variables_read() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for package in SERVICES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            for match in READ.finditer(path.read_text(encoding="utf-8")):
                name = match.group(1) or match.group(2)
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_services_read_is_a_splitserve_one() -> None:
    found = variables_read()
    assert "SPLITSERVE_KERNELS" in found and "SPLITSERVE_CLUSTER_TOKEN" in found  # it sees them
    stray = {name: where for name, where in found.items()
             if not name.startswith(ENV_PREFIX) and name not in OTHER_TOOLS}
    assert not stray, f"environment variables without the {ENV_PREFIX} prefix: {stray}"
