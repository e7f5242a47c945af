"""The subset of kustomize that deploy/k8s uses, in Python: so the overlays are rendered and
checked where neither `kustomize` nor `kubectl` is installed. tests/deploy/test_kustomize.py
checks it against `kubectl kustomize` wherever kubectl is installed.

Handled, as kustomize does it: `resources` (manifest files and directories holding a
kustomization), `components` (directories holding a `Component`), `labels` with `pairs` only
(added to each object's metadata.labels, not to selectors or templates) and `patches` given
inline that delete an object (`$patch: delete`). A kustomization using anything else is
refused with an error naming the field, so a rendering here can never silently differ from
kustomize's.
"""

from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]
KUSTOMIZATION = ("kustomize.config.k8s.io/v1beta1", "Kustomization")
COMPONENT = ("kustomize.config.k8s.io/v1alpha1", "Component")
FIELDS = {"apiVersion", "kind", "resources", "components", "labels", "patches"}


class UnsupportedKustomization(ValueError):
    """The kustomization uses something this renderer does not do."""


def documents(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def object_key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def render(directory: Path) -> list[Doc]:
    """The objects `kustomize build directory` emits (in no particular order)."""
    return _build(directory, KUSTOMIZATION)


def _build(directory: Path, expected: tuple[str, str]) -> list[Doc]:
    path = directory / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text())
    if (spec.get("apiVersion"), spec.get("kind")) != expected:
        raise UnsupportedKustomization(f"{path}: apiVersion/kind must be {expected}")
    if unknown := set(spec) - FIELDS:
        raise UnsupportedKustomization(f"{path}: unsupported fields {sorted(unknown)}")
    objects: list[Doc] = []
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        objects += _build(target, KUSTOMIZATION) if target.is_dir() else documents(target)
    for entry in spec.get("components", []):
        objects += _build((directory / entry).resolve(), COMPONENT)
    for patch in spec.get("patches", []):
        objects = _delete(objects, patch, path)
    for entry in spec.get("labels", []):
        objects = [_labelled(doc, entry, path) for doc in objects]
    keys = [object_key(d) for d in objects]
    if duplicates := {k for k in keys if keys.count(k) > 1}:
        raise UnsupportedKustomization(f"{path}: objects declared twice {sorted(duplicates)}")
    return objects


def _delete(objects: list[Doc], patch: Doc, path: Path) -> list[Doc]:
    if set(patch) != {"patch"}:
        raise UnsupportedKustomization(f"{path}: patches: only inline `patch` is supported")
    body = yaml.safe_load(patch["patch"])
    if body.get("$patch") != "delete" or set(body) != {"$patch", "apiVersion", "kind",
                                                        "metadata"}:
        raise UnsupportedKustomization(f"{path}: patches: only `$patch: delete` is supported")
    target = (body["apiVersion"], *object_key(body))
    kept = [d for d in objects if (d["apiVersion"], *object_key(d)) != target]
    if len(kept) != len(objects) - 1:
        raise UnsupportedKustomization(f"{path}: patches: {target} matches no object")
    return kept


def _labelled(doc: Doc, entry: Doc, path: Path) -> Doc:
    if set(entry) != {"pairs"}:
        raise UnsupportedKustomization(f"{path}: labels: only `pairs` is supported")
    metadata = {**doc["metadata"], "labels": {**doc["metadata"].get("labels", {}),
                                              **entry["pairs"]}}
    return {**doc, "metadata": metadata}
