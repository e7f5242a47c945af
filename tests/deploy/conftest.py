"""The deploy/k8s tests' fixtures: every object of every manifest, and each kustomization a
user applies rendered, once per module."""

import pytest

from tests.deploy.manifests import TARGETS, Doc, Objects, all_objects, object_key, render


@pytest.fixture(scope="module")
def objects() -> Objects:
    return all_objects()


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[tuple[str, str], Doc]]:
    """target name -> its rendered objects by (kind, name)."""
    return {name: {object_key(d): d for d in render(path)} for name, path in TARGETS.items()}
