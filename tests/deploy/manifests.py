"""What the deploy/k8s tests share: the manifests as objects, their containers' environments as
the kubelet hands them over, and each kustomization rendered (by `kubectl kustomize` where
kubectl is installed, else by tests/deploy/kustomize.py's rendering of the same subset)."""

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.deploy import kustomize

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
POD_IP = "10.1.2.3"
# The kustomizations a user applies: the plain CPU set and the two serving overlays.
TARGETS = {"plain": K8S, "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}

Doc = dict[str, Any]
Objects = dict[tuple[str, str], Doc]
documents = kustomize.documents
object_key = kustomize.object_key


def manifest_files() -> list[Path]:
    """Every manifest under deploy/k8s (kustomizations aside)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def all_objects() -> Objects:
    """Every object of every manifest, by (kind, name), each declared once."""
    found: Objects = {}
    for path in manifest_files():
        for doc in documents(path):
            key = object_key(doc)
            assert key not in found, f"{key} declared twice"
            found[key] = doc
    return found


def render(directory: Path) -> list[Doc]:
    """`kubectl kustomize directory` where kubectl is installed, else the Python rendering."""
    if shutil.which("kubectl") is None:
        return kustomize.render(directory)
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def deployment(objects: Objects, component: str) -> Doc:
    return objects[("Deployment", f"splitserve-{component}")]


def container(objects: Objects, component: str) -> Doc:
    (only,) = deployment(objects, component)["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def resolved_env(c: Doc, secrets: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet hands it over: the pod's address where a
    variable takes it (a fieldRef or $(POD_IP)); a Secret's key where `secrets` holds it
    ((secret name, key) -> value), else left out (as an optional reference to a missing
    Secret is)."""
    resolved = {}
    for key, value in env_of(c).items():
        if value == {"fieldRef": {"fieldPath": "status.podIP"}}:
            resolved[key] = POD_IP
        elif isinstance(value, str):
            resolved[key] = value.replace("$(POD_IP)", POD_IP)
        elif "secretKeyRef" in value:
            ref = value["secretKeyRef"]
            if (ref["name"], ref["key"]) in (secrets or {}):
                resolved[key] = (secrets or {})[(ref["name"], ref["key"])]
    return resolved
