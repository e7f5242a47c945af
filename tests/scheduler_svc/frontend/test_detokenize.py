"""The public Detokenize RPC: each sequence decoded on its own with the real tokenizer (special
tokens kept unless asked), ids outside the vocabulary and another model's name refused as
INVALID_ARGUMENT. Driven through the servicer, with no server or network."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.frontend.servicer import GenerationServicer
from scheduler_svc.frontend.validation import Limits
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import generation_pb2
from tests.scheduler_svc.frontend.fakes import make_frontend
from tests.scheduler_svc.grpc_context import Aborted, FakeContext


@pytest.fixture
def servicer(model_path: Path, tokenizer) -> Iterator[GenerationServicer]:  # type: ignore[no-untyped-def]
    frontend = make_frontend(tokenizer, Limits("smol", tokenizer.vocab_size, 8192))
    yield GenerationServicer(frontend, load_model_config(model_path), SchedulerConfig(),
                             served_name="smol")
    frontend.close()


def detokenize(servicer: GenerationServicer, *sequences: list[int], model: str = "",
               skip_special_tokens: bool = False) -> list[str]:
    request = generation_pb2.DetokenizeRequest(
        model=model, sequences=[generation_pb2.TokenIds(ids=s) for s in sequences],
        skip_special_tokens=skip_special_tokens)
    response = asyncio.run(servicer.Detokenize(request, FakeContext()))  # type: ignore[arg-type]
    return list(response.texts)


def test_each_sequence_is_decoded_on_its_own(servicer: GenerationServicer, tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "<|im_start|>user\nHello, wörld! 12"
    ids = tokenizer.encode(text)
    assert detokenize(servicer, ids, [ids[0]], []) == [text, "<|im_start|>", ""]
    assert detokenize(servicer, ids, skip_special_tokens=True) == ["user\nHello, wörld! 12"]
    # Half a character (the byte-level token of 0xC3 alone) decodes to U+FFFD, as a one-token
    # decode does in HF and vLLM.
    assert detokenize(servicer, [tokenizer.tokenizer.token_to_id("Ã")]) == ["\ufffd"]


def test_ids_outside_the_vocabulary_and_other_models_are_refused(
        servicer: GenerationServicer, tokenizer) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Aborted) as refused:
        detokenize(servicer, [1, 2], [3, tokenizer.vocab_size])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details == (f"sequences[1]: token id {tokenizer.vocab_size} is outside "
                                     f"the vocabulary (0..{tokenizer.vocab_size - 1})")
    with pytest.raises(Aborted) as refused:
        detokenize(servicer, [1], model="other")
    assert "unknown model 'other'" in refused.value.details
    assert detokenize(servicer, [1], model="smol") == ["<|im_start|>"]
