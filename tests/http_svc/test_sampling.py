"""The OpenAI parameters' mapping onto the engine's sampling, as vLLM maps them: defaults,
ranges (400 naming the field), and the parameters the engine does not have yet (400 unless
neutral). No network: request models in, `Sampling` or ApiError out."""

import math
from typing import Any

import pytest

from http_svc.errors import ApiError
from http_svc.protocol import ChatCompletionRequest, CompletionRequest
from http_svc.sampling import NOT_YET, Sampling, chat_sampling, completion_sampling
from http_svc.scheduler_client import GenerateSpec, Prompt, spec_to_pb

USER = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> Sampling:
    return completion_sampling(CompletionRequest.model_validate({"prompt": "x", **fields}))


def chat(**fields: Any) -> Sampling:
    return chat_sampling(ChatCompletionRequest.model_validate({"messages": USER, **fields}))


def refusal(make: Any, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as refused:
        make(**fields)
    assert refused.value.status == 400
    return refused.value


def test_defaults_are_vllms() -> None:
    s = completion()
    # Unset knobs stay unset: the scheduler fills them (the model's generation config, else
    # vLLM's defaults).
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.min_tokens) == (None, None, None, None, 0)
    assert (s.min_p, s.repetition_penalty) == (None, None)
    assert (s.stop, s.stop_token_ids, s.ignore_eos, s.logprobs) == ((), (), False, None)
    assert s.max_tokens == 16                           # OpenAI's completions default
    assert not s.keep_special_tokens                    # skip_special_tokens defaults to true
    assert completion(max_tokens=None).max_tokens is None   # explicit null: fill the context
    assert chat().max_tokens is None                    # chat: the rest of the context
    assert chat(max_tokens=7).max_tokens == 7
    assert chat(max_tokens=7, max_completion_tokens=9).max_tokens == 9   # the newer one wins


def test_values_pass_through() -> None:
    s = completion(temperature=0, top_p=0.5, top_k=40, seed=7, max_tokens=5, min_tokens=2,
                   stop=["a", "bc"], stop_token_ids=[3, 4], ignore_eos=True, logprobs=3,
                   skip_special_tokens=False, user="ignored")
    assert s == Sampling(temperature=0.0, top_p=0.5, top_k=40, seed=7, max_tokens=5,
                         min_tokens=2, stop=("a", "bc"), stop_token_ids=(3, 4), ignore_eos=True,
                         logprobs=3, keep_special_tokens=True)
    assert completion(stop="end").stop == ("end",)      # a string or a list
    assert completion(top_k=-1).top_k == -1


def test_negative_seeds_keep_their_64_bits() -> None:
    assert completion(seed=-1).seed == (1 << 64) - 1
    assert completion(seed=-(1 << 63)).seed == 1 << 63
    assert "seed" == refusal(completion, seed=1 << 63).param


def test_logprobs_shapes_of_each_endpoint() -> None:
    assert completion(logprobs=0).logprobs == 0
    assert completion(logprobs=20).logprobs == 20
    assert chat(logprobs=True).logprobs == 0            # the sampled token only
    assert chat(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat(logprobs=False, top_logprobs=0).logprobs is None
    assert refusal(completion, logprobs=21).param == "logprobs"
    assert refusal(chat, logprobs=True, top_logprobs=-1).param == "top_logprobs"
    error = refusal(chat, top_logprobs=2)
    assert (error.param, error.message) == ("top_logprobs", "top_logprobs needs logprobs: true")


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1 << 31}, "max_tokens"),
    ({"min_tokens": 17}, "min_tokens"),        # above the default max_tokens of 16
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop": ["a", ""]}, "stop"),
])
def test_bad_values_name_their_field(fields: dict[str, Any], param: str) -> None:
    assert refusal(completion, **fields).param == param


def test_chat_names_the_max_tokens_field_it_was_given() -> None:
    assert refusal(chat, max_completion_tokens=0).param == "max_completion_tokens"
    assert refusal(chat, max_tokens=0).param == "max_tokens"


NEUTRAL = {
           "include_stop_str_in_output": False, "response_format": {"type": "text"},
           "structured_outputs": None, "guided_json": None, "guided_regex": None,
           "guided_choice": None, "guided_grammar": None}


def test_neutral_values_of_what_the_engine_lacks_are_accepted() -> None:
    chat(**NEUTRAL)
    completion(**NEUTRAL, suffix=None, best_of=1)


def test_completion_only_parameters() -> None:
    error = refusal(completion, suffix="tail")
    assert error.param == "suffix"
    assert error.message.startswith("suffix is not supported yet: only ")
    assert refusal(completion, best_of=3).param == "best_of"


def test_not_yet_covers_each_parameter_once() -> None:
    names = [entry.name for entry in NOT_YET]
    assert len(names) == len(set(names))
    # Served now: not in the list, so never refused.
    assert not {"include_stop_str_in_output", "guided_grammar"} & set(names)


def test_include_stop_str_in_output_is_carried() -> None:
    for make in (chat, completion):
        assert make().include_stop_str_in_output is False
        assert make(include_stop_str_in_output=True, stop="x").include_stop_str_in_output
        assert make(include_stop_str_in_output=True, stream=True).include_stop_str_in_output
    # On the gRPC request only when set (unset: the scheduler's default, false).
    kept = spec_to_pb(GenerateSpec("r", Prompt(text="x"), chat(include_stop_str_in_output=True)))
    assert kept.sampling.HasField("include_stop_str_in_output")
    assert kept.sampling.include_stop_str_in_output
    plain = spec_to_pb(GenerateSpec("r", Prompt(text="x"), chat()))
    assert not plain.sampling.HasField("include_stop_str_in_output")


def test_guided_grammar_is_carried() -> None:
    for make in (chat, completion):
        structured = make(guided_grammar='root ::= "yes" | "no"').structured
        assert structured is not None
        assert (structured.param, structured.grammar) == ("guided_grammar",
                                                          'root ::= "yes" | "no"')


@pytest.mark.parametrize("fields, message", [
    ({"n": 0}, "n must be in [1, 64], got 0"),
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0.0"),
    ({"min_p": 2}, "min_p must be in [0, 1], got 2.0"),
])
def test_invalid_values_are_invalid_before_unsupported(fields: dict[str, Any],
                                                       message: str) -> None:
    assert refusal(chat, **fields).message == message


def test_stream_options() -> None:
    chat(stream=True, stream_options={"include_usage": True})
    assert refusal(chat, stream_options={"include_usage": True}).param == "stream_options"
    # vLLM's continuous usage stats are served (guidellm always asks for them).
    chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
