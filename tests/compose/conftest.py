"""The compose tests' fixtures: Compose's normalized config of compose.yaml, and of it with the
GPU override, once per module."""

from typing import Any

import pytest

from tests.compose.files import GPU_OVERRIDE, ROOT, compose_config


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return compose_config([ROOT / "compose.yaml"], tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return compose_config([ROOT / "compose.yaml", GPU_OVERRIDE], tmp_path_factory.mktemp("home"))
