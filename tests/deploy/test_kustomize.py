"""deploy/k8s/'s kustomizations: what each target a user applies renders to (the plain CPU set,
the CPU and GPU serving overlays), every rendered object valid, every manifest reachable, and
tests/deploy/kustomize.py's rendering equal to `kubectl kustomize`'s wherever kubectl is
installed (elsewhere it stands in for it). No cluster is contacted.
"""

import shutil
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy import crd_schemas, kustomize
from tests.deploy.manifests import K8S, TARGETS, Doc, manifest_files, object_key, render

Rendered = dict[str, dict[tuple[str, str], Doc]]
CORE = {("PersistentVolumeClaim", "splitserve-models"), ("Job", "splitserve-model-init"),
        ("Deployment", "splitserve-kvcache"), ("Service", "splitserve-kvcache"),
        ("Deployment", "splitserve-scheduler"), ("Service", "splitserve"),
        ("Service", "splitserve-control"), ("Deployment", "splitserve-http"),
        ("Service", "splitserve-http"), ("NetworkPolicy", "splitserve-internal"),
        ("NetworkPolicy", "splitserve-public"), ("NetworkPolicy", "splitserve-http-public")}


def workers(kind: str) -> set[tuple[str, str]]:
    return {("Deployment", f"splitserve-{kind}"), ("PodDisruptionBudget", f"splitserve-{kind}")}


SERVING = {("ServiceMonitor", "splitserve")}


def test_each_target_renders_its_set(rendered: Rendered) -> None:
    assert set(rendered["plain"]) == CORE | workers("worker")      # core APIs only
    assert set(rendered["cpu"]) == CORE | workers("worker") | SERVING | {
        ("ScaledObject", "splitserve-worker")}
    # GPU workers in place of the CPU ones, not beside them.
    assert set(rendered["gpu"]) == CORE | workers("worker-gpu") | SERVING | {
        ("ScaledObject", "splitserve-worker-gpu")}
    for objects in rendered.values():
        for so in [d for (kind, _), d in objects.items() if kind == "ScaledObject"]:
            assert ("Deployment", so["spec"]["scaleTargetRef"]["name"]) in objects


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_rendered_object_is_valid_and_labelled(rendered: Rendered, target: str) -> None:
    for doc in rendered[target].values():
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "splitserve"
        if crd_schemas.is_custom(doc):
            crd_schemas.validate(doc)
        else:
            kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_every_manifest_is_rendered_somewhere(rendered: Rendered) -> None:
    declared = {object_key(d) for path in manifest_files() for d in kustomize.documents(path)}
    assert declared == {key for objects in rendered.values() for key in objects}


def test_the_gpu_overlay_changes_only_the_workers(rendered: Rendered) -> None:
    for key in CORE | SERVING:
        assert rendered["gpu"][key] == rendered["cpu"][key], key


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_python_rendering_is_kubectls(target: str) -> None:
    """The stand-in for kustomize, where kubectl is missing, renders exactly what it does."""
    ours = {object_key(d): d for d in kustomize.render(TARGETS[target])}
    assert ours == {object_key(d): d for d in render(TARGETS[target])}


def write_kustomization(directory: Path, **fields: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **fields}))


def test_the_python_rendering_refuses_what_it_does_not_do(tmp_path: Path) -> None:
    base = str(K8S / "base")
    write_kustomization(tmp_path / "prefix", resources=[base], namePrefix="x-")
    with pytest.raises(kustomize.UnsupportedKustomization, match="namePrefix"):
        kustomize.render(tmp_path / "prefix")
    write_kustomization(tmp_path / "merge", resources=[base], patches=[{"patch": yaml.safe_dump(
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "splitserve-http"},
         "spec": {"replicas": 5}})}])
    with pytest.raises(kustomize.UnsupportedKustomization, match=r"\$patch: delete"):
        kustomize.render(tmp_path / "merge")
    write_kustomization(tmp_path / "nothing", resources=[base], patches=[{"patch": yaml.safe_dump(
        {"$patch": "delete", "apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "splitserve-nobody"}})}])
    with pytest.raises(kustomize.UnsupportedKustomization, match="matches no object"):
        kustomize.render(tmp_path / "nothing")


def test_the_custom_resource_checks_check() -> None:
    """A misplaced HPA field, a number where KEDA takes a string, a misspelt endpoint field and
    a missing selector are each refused, naming the field."""
    import jsonschema

    (so,) = kustomize.documents(K8S / "overlays" / "cpu" / "scaled-object.yaml")
    (monitor,) = kustomize.documents(K8S / "components" / "monitoring" / "service-monitor.yaml")
    crd_schemas.validate(so)
    crd_schemas.validate(monitor)
    broken = [
        ({**so, "spec": {**so["spec"], "minReplicas": 1}}, "minReplicas"),
        ({**so, "spec": {**so["spec"], "triggers": [{**so["spec"]["triggers"][0], "metadata": {
            **so["spec"]["triggers"][0]["metadata"], "threshold": 4}}]}}, "threshold"),
        ({**monitor, "spec": {**monitor["spec"], "endpoints": [{"prot": "metrics"}]}}, "prot"),
        ({**monitor, "spec": {"endpoints": monitor["spec"]["endpoints"]}}, "selector"),
    ]
    for doc, field in broken:
        with pytest.raises(jsonschema.ValidationError) as refused:
            crd_schemas.validate(doc)
        assert field in str(refused.value.message) + str(list(refused.value.path)), field
