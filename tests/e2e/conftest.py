"""Fixtures for the end-to-end tests: prompts, the HF oracle, the default cluster."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_svc.frontend.tokenizer import ChatMessage
from tests.e2e.harness import HFOracle, RunningCluster, run_cluster

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to cook.",
    "What does a CPU do?",
    "Describe a rainy morning in a small village, with the smell of bread and wet stones.",
    "Translate 'good night' into Spanish.",
    "Why is the sky blue?",
    "Name a famous painting.",
    "How many legs does a spider have?",
    "Suggest a name for a pet turtle.",
    "What is 12 times 12?",
    "Tell me a fun fact about octopuses.",
    "Summarize the plot of Cinderella in two sentences.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(tokenizer.render_chat([ChatMessage("user", q)], True))
            for q in QUESTIONS]


@pytest.fixture(scope="session")
def oracle(model_path: Path) -> HFOracle:
    return HFOracle(model_path)


@pytest.fixture(scope="session")
def references(oracle: HFOracle, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running
