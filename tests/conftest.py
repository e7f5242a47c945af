"""Shared fixtures: the default model's path, its tokenizer, HF transformers as oracle, and a ZMQ
context per test."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from services.model_config import default_model_path


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):  # type: ignore[no-untyped-def]
    from scheduler_svc.frontend.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A ZMQ context for one test, terminated after it (every socket must be closed)."""
    context = zmq.Context()
    yield context
    context.term()
