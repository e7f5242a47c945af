"""A Qwen3 model through the real services (kvcache_svc, scheduler_svc, a CPU worker; real
processes on real sockets): greedy tokens equal HF transformers' in fp32 on the same tiny
random weights (scripts/random_family.py, with SmolLM2's tokenizer), and the replica reports
the family (ModelInfo)."""

from pathlib import Path

import pytest
import torch

from scripts.random_family import build_family_model
from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.harness import greedy_request, hf_greedy_tokens, stream_tokens
from tests.gpu.cluster import gpu_cluster

NUM_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("models") / "qwen3-2"
    model = build_family_model(path, "qwen3", vocab_size=49152, tokenizer=True,
                               attention_bias=True)
    return path, model


def test_qwen3_greedy_through_the_services_matches_hf(tmp_path: Path,
                                                      qwen3) -> None:  # type: ignore[no-untyped-def]
    path, model = qwen3
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (21, 6)]
    references = [hf_greedy_tokens(model, p, NUM_NEW_TOKENS) for p in prompts]
    assert len({t for r in references for t in r}) >= 6, references
    with gpu_cluster(tmp_path, path, device="cpu") as cluster:
        info = cluster.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
        assert info.architecture == "qwen3"
        for prompt, reference in zip(prompts, references, strict=True):
            ids, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, NUM_NEW_TOKENS))
            assert ids == reference
