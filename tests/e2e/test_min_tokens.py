"""min_tokens through the services (real processes), as vLLM means it: on a model rigged to
want EOS at once, a request still gets exactly min_tokens tokens before EOS, greedy or
sampled; its stop token ids are held back as long, and EOS too under ignore_eos.

The model: random SmolLM2-shape weights (2 layers, float32, scripts/random_model.py) with a
constant added to one hidden dimension of every token embedding and as much again to EOS's
row. The embedding is tied to the LM head, so every logit shifts alike but EOS's, which
leads the next best by thousands at every position."""

from collections.abc import Iterator

import pytest
from safetensors.torch import load_file, save_file

from scripts.random_model import EOS_TOKEN_ID, build_model
from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.harness import RunningCluster, stream_tokens
from tests.gpu.cluster import gpu_cluster

PROMPT = [812, 4051, 77, 30190, 5512, 901, 64]
SHIFT = 100.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    model = build_model(tmp_path_factory.mktemp("models") / "wants-eos", "smollm2",
                        num_layers=2, dtype="float32")
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    embedding = tensors["model.embed_tokens.weight"]
    embedding[:, 0] += SHIFT
    embedding[EOS_TOKEN_ID, 0] += SHIFT
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with gpu_cluster(tmp_path_factory.mktemp("logs"), model, device="cpu") as running:
        yield running


def generate(cluster: RunningCluster, **sampling: object
             ) -> tuple[list[int], generation_pb2.GenerateResponse]:
    params = generation_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": 12,
                                              **sampling})
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=PROMPT), sampling=params)
    ids, _, last = stream_tokens(cluster.stub, request, timeout=120)
    return ids, last


def test_the_rigged_model_wants_eos_at_once(cluster: RunningCluster) -> None:
    ids, last = generate(cluster)
    assert ids == [EOS_TOKEN_ID] and last.finish_reason == "stop"


@pytest.mark.parametrize("sampling", [{"min_tokens": 5},
                                      {"min_tokens": 4, "temperature": 1.0, "seed": 7}])
def test_min_tokens_come_before_eos(cluster: RunningCluster,
                                   sampling: dict[str, object]) -> None:
    ids, last = generate(cluster, **sampling)
    min_tokens = sampling["min_tokens"]
    assert len(ids) == min_tokens + 1 and ids[-1] == EOS_TOKEN_ID, ids   # type: ignore[operator]
    assert EOS_TOKEN_ID not in ids[:-1]
    assert last.finish_reason == "stop"
    assert last.usage.completion_tokens == min_tokens + 1     # type: ignore[operator]


def test_stop_token_ids_and_eos_are_held_back_under_ignore_eos(cluster: RunningCluster) -> None:
    """The rig's second favourite is a stop id: it cannot end the request before min_tokens;
    with ignore_eos, EOS is no ending but is still masked until then (vLLM masks it too)."""
    ids, _ = generate(cluster, min_tokens=1, max_tokens=3)
    second = ids[0]                                   # what the model says when EOS may not
    ids, last = generate(cluster, min_tokens=3, max_tokens=5, stop_token_ids=[second],
                         ignore_eos=True)
    assert not {EOS_TOKEN_ID, second} & set(ids[:3]), ids
    assert ids[3:] == [EOS_TOKEN_ID, EOS_TOKEN_ID] and last.finish_reason == "length"
