"""Project-wide rules: services never import each other; `services` imports no service; the
worker's kernel packages are leaves; the checked-in gRPC stubs are what the protos generate."""

import ast
import filecmp
from pathlib import Path

from services.rpc.regen import regenerate

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("scheduler_svc", "worker_svc", "kvcache_svc", "http_svc")


def imported_packages(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_services_never_import_each_other() -> None:
    for svc in SERVICES:
        imports = imported_packages(svc)
        for other in SERVICES:
            if other != svc:
                assert other not in imports, f"{svc} imports {other} in {imports[other]}"


def test_shared_library_imports_no_service() -> None:
    imports = imported_packages("services")
    for svc in SERVICES:
        assert svc not in imports, f"services imports {svc} in {imports[svc]}"


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every module the files under `package` (a dotted name) import, relative imports
    resolved, mapped to the files that import it."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package.replace(".", "/")).rglob("*.py"):
        home = list(path.relative_to(ROOT).parts[:-1])      # the file's own package
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = home[:len(home) - node.level + 1] if node.level else []
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_worker_kernels_are_leaves() -> None:
    # The kernels and their twins take tensors and return tensors: they import nothing of the
    # worker's outside their own package (not the sampler, not the model's weight format),
    # except the KV cache's 8-bit format, whose reference every attention path shares.
    shared = {"worker_svc.kernels.kv_quant"}
    for package in ("worker_svc.kernels", "worker_svc.triton_kernels"):
        for module, files in imported_modules(package).items():
            if module == "worker_svc" or module.startswith("worker_svc."):
                assert module in shared or module == package or \
                    module.startswith(package + "."), \
                    f"{sorted(files)} import {module}, outside {package}"


def test_checked_in_stubs_are_current(tmp_path: Path) -> None:
    regenerate(tmp_path)
    ours = ROOT / "services" / "rpc" / "splitserve" / "v1"
    fresh = tmp_path / "splitserve" / "v1"
    names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    assert names == sorted(p.name for p in ours.iterdir() if p.is_file() and p.suffix != ".pyc")
    match, mismatch, errors = filecmp.cmpfiles(ours, fresh, names, shallow=False)
    assert not mismatch and not errors, f"stale stubs (run python -m services.rpc.regen): " \
                                        f"{mismatch + errors}"


# scheduler_svc by layer (issue 37): the engine core knows nothing above it, the cluster knows
# the engine's contracts, the front ends know both. What each layer may import of scheduler_svc.
LAYERS = {
    "scheduler_svc.engine": ("scheduler_svc.engine",),
    "scheduler_svc.cluster": ("scheduler_svc.cluster", "scheduler_svc.engine",
                              "scheduler_svc.config"),
    "scheduler_svc.frontend": ("scheduler_svc.frontend", "scheduler_svc.cluster.wire",
                               "scheduler_svc.engine", "scheduler_svc.config"),
}
# What the engine core never touches: client streams, protobuf and text.
NOT_IN_THE_ENGINE = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf",
                     "services.rpc", "jinja2", "tokenizers", "transformers")


def test_scheduler_layers_import_downwards_only() -> None:
    for layer, allowed in LAYERS.items():
        for module, files in imported_modules(layer).items():
            if module == "scheduler_svc" or module.startswith("scheduler_svc."):
                assert any(module == a or module.startswith(a + ".") for a in allowed), \
                    f"{sorted(files)} import {module}, above {layer}"


def test_the_engine_core_imports_no_text_protobuf_or_grpc() -> None:
    for module, files in imported_modules("scheduler_svc.engine").items():
        for banned in NOT_IN_THE_ENGINE:
            assert not (module == banned or module.startswith(banned + ".")), \
                f"{sorted(files)} import {module}"


def test_scheduler_modules_import_no_circle() -> None:
    # Every import counts, those under TYPE_CHECKING too (the old stats.py <-> engine,
    # membership and router circle was one of those).
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "scheduler_svc").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = set()
    for name in graph:
        path = ROOT / (name.replace(".", "/") + ".py")
        if not path.is_file():
            path = ROOT / name.replace(".", "/") / "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names)
        graph[name] = {m for m in graph[name] if m in graph and m != name}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError(" -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for dep in graph[name]:
            visit(dep, path + [name])
        done.add(name)

    for name in graph:
        visit(name, [])
