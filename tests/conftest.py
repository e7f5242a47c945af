"""Shared fixtures: the default model's path, its tokenizer, and HF transformers as oracle."""

from pathlib import Path

import pytest

from services.model_config import default_model_path


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):  # type: ignore[no-untyped-def]
    from scheduler_svc.tokenizer import load_tokenizer

    return load_tokenizer(model_path)
