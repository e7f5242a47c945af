"""GPU tests: everything here needs CUDA and is skipped, at collection, without it.

The model is a random-weight SmolLM2-shape directory built by scripts/random_model.py (float32
weights, full depth unless SPLITSERVE_GPU_TEST_LAYERS says fewer), or the one named by
SPLITSERVE_GPU_MODEL (scripts/gpu-check builds it once). Without the GGUF, as on the GPU
machines, the tokenizer comes from SPLITSERVE_GPU_TOKENIZER (a directory exported with
`scripts/random_model.py --export-tokenizer DIR`). `model_path` overrides the root conftest's,
so its `tokenizer` fixture reads this model's tokenizer. SPLITSERVE_GPU_TEST_DEVICE=cpu runs
them on the CPU instead, to check the tests themselves (tests/gpu/cluster.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scheduler_svc.frontend.tokenizer import TextTokenizer
from tests.gpu.cluster import device_under_test
from tests.gpu.oracle import CudaOracle

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MAX_TOKENS = 32

# SmolLM2's chat layout written out, so the prompts need no chat template: what the model
# computes on is all that matters here.
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = [
    "Name three rivers in Europe.",
    "Why do cats purr?",
    "Write two lines about autumn leaves.",
    "What is the square root of 144?",
    "Explain what a compiler does to a beginner.",
    "Which planet has the most moons?",
    "Give a one-word synonym for happy.",
    "Describe the walk from a quiet harbour up to the old castle on the hill, the fishing "
    "boats, the gulls over the market, the narrow stairs between the houses, and the view "
    "over the bay once you reach the top, in as much detail as you can manage.",
    "How does a refrigerator keep food cold?",
    "Translate 'thank you' into German.",
    "What is a haiku?",
    "Suggest a name for a bakery.",
    "How many continents are there?",
    "What colour do you get mixing blue and yellow?",
    "Tell me something surprising about trees.",
    "Summarize the story of the tortoise and the hare.",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() or device_under_test() == "cpu":
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU (torch {torch.__version__} sees none); "
                            "scripts/gpu-check runs these on a GPU machine")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


def chat_prompt(question: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if given := os.environ.get("SPLITSERVE_GPU_MODEL"):
        return Path(given)
    out = tmp_path_factory.mktemp("models") / "smollm2-fp32"
    cmd = [sys.executable, str(ROOT / "scripts" / "random_model.py"), str(out),
           "--shape", "smollm2", "--dtype", "float32"]
    if tokenizer := os.environ.get("SPLITSERVE_GPU_TOKENIZER"):
        cmd += ["--tokenizer", tokenizer]
    if layers := os.environ.get("SPLITSERVE_GPU_TEST_LAYERS"):
        cmd += ["--layers", layers]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"building the random model failed:\n{done.stderr[-3000:]}")
    return out


@pytest.fixture(scope="session")
def prompts(tokenizer: TextTokenizer) -> list[list[int]]:
    return [tokenizer.encode(chat_prompt(q)) for q in QUESTIONS]


@pytest.fixture(scope="session")
def oracle(model_path: Path) -> CudaOracle:
    return CudaOracle(model_path, device_under_test())


@pytest.fixture(scope="session")
def references(oracle: CudaOracle, prompts: list[list[int]],
               ) -> list[tuple[list[int], list[float]]]:
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]

