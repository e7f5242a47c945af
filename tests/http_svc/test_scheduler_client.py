"""The gRPC edge's conversions: a GenerateSpec becomes the GenerateRequest the scheduler
validates (optional fields set only when given, one prompt form), and a GenerateResponse
becomes a Chunk (usage and stop reason only where the scheduler set them)."""

import pytest

from http_svc.sampling import Sampling
from http_svc.scheduler_client import (
    Chunk,
    GenerateSpec,
    Prompt,
    TokenLogprob,
    Usage,
    chunk_from_pb,
    spec_to_pb,
)
from services.rpc.splitserve.v1 import generation_pb2 as pb

SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=0, seed=None, max_tokens=None,
                    min_tokens=1, stop=("END",), stop_token_ids=(7,), ignore_eos=True,
                    logprobs=None, keep_special_tokens=True)


def test_a_spec_becomes_the_request_the_scheduler_validates() -> None:
    request = spec_to_pb(GenerateSpec("cmpl-1", Prompt(text="Hi"), SAMPLING, "salt"))
    assert (request.request_id, request.text, request.cache_salt) == ("cmpl-1", "Hi", "salt")
    assert request.keep_special_tokens and not request.HasField("chat")
    s = request.sampling
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert (s.top_k, s.min_tokens, list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (
        0, 1, ["END"], [7], True)
    # Unset: the engine picks a seed, fills its default max_tokens, returns no logprobs, and
    # takes min_p and repetition_penalty from the model's generation config (or vLLM's).
    assert not any(s.HasField(f) for f in ("seed", "max_tokens", "logprobs", "min_p",
                                           "repetition_penalty"))


def test_unset_knobs_reach_the_scheduler_unset() -> None:
    """The model's generation_config.json defaults apply to HTTP clients too: a knob the
    client did not send must not arrive as vLLM's default, which would hide the model's."""
    unset = Sampling(None, None, None, None, None, 0, (), (), False, None, False)
    s = spec_to_pb(GenerateSpec("r", Prompt(text="Hi"), unset)).sampling
    assert not any(s.HasField(f) for f in ("temperature", "top_p", "top_k", "min_p",
                                           "repetition_penalty"))
    zero = Sampling(0.0, 1.0, 0, None, None, 0, (), (), False, None, False, min_p=0.0,
                    repetition_penalty=1.0)
    s = spec_to_pb(GenerateSpec("r", Prompt(text="Hi"), zero)).sampling
    assert all(s.HasField(f) for f in ("temperature", "top_p", "top_k", "min_p",
                                       "repetition_penalty"))
    assert (s.temperature, s.top_k, s.min_p) == (0.0, 0, 0.0)


def test_optional_fields_and_prompt_forms() -> None:
    sampling = Sampling(0.0, 1.0, -1, (1 << 64) - 1, 5, 0, (), (), False, 0, False)
    request = spec_to_pb(GenerateSpec("r", Prompt(token_ids=(1, 2)), sampling))
    assert (request.sampling.seed, request.sampling.max_tokens, request.sampling.logprobs) == (
        (1 << 64) - 1, 5, 0)
    assert list(request.token_ids.ids) == [1, 2] and not request.HasField("text")
    chat = spec_to_pb(GenerateSpec("r", Prompt(chat=(("user", "a"), ("assistant", ""))),
                                   sampling))
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "a"),
                                                                 ("assistant", "")]


def test_a_response_becomes_a_chunk() -> None:
    middle = pb.GenerateResponse(token_ids=[3, 4], text="ab", logprobs=[
        pb.TokenLogprob(token_id=3, logprob=-0.5, top=[pb.TopLogprob(token_id=3, logprob=-0.5)]),
        pb.TokenLogprob(token_id=4, logprob=-1.5)])
    assert chunk_from_pb(middle) == Chunk((3, 4), "ab", (TokenLogprob(3, -0.5, ((3, -0.5),)),
                                                         TokenLogprob(4, -1.5, ())))
    last = pb.GenerateResponse(token_ids=[5], finish_reason="stop", stop_reason="END",
                               usage=pb.Usage(prompt_tokens=9, completion_tokens=3,
                                              cached_prompt_tokens=8))
    assert chunk_from_pb(last) == Chunk((5,), "", (), "stop", "END", Usage(9, 3, 8))
    assert chunk_from_pb(pb.GenerateResponse(finish_reason="length")).stop_reason is None
