"""The response objects' pieces: both logprobs shapes (candidate order, the floor for -inf,
text offsets, bytes), stop reasons typed as vLLM types them, usage sums."""

import math

from http_svc.outputs import (
    chat_logprobs,
    completion_logprobs,
    stop_reason,
    usage_body,
)
from http_svc.sampling import Sampling
from http_svc.scheduler_client import Chunk, TokenLogprob, Usage

VOCAB = ["<s>", " Paris", ".", " London", "\ufffd", "é"]

# As the engine answers logprobs=2: the sampled token and the two best.
SAMPLED_BEST = TokenLogprob(1, -0.1, ((1, -0.1), (3, -2.5)))
SAMPLED_ELSEWHERE = TokenLogprob(2, -4.0, ((1, -0.2), (3, -math.inf)))


def sampling(stop: tuple[str, ...] = (), stop_token_ids: tuple[int, ...] = ()) -> Sampling:
    return Sampling(1.0, 1.0, 0, None, 16, 0, stop, stop_token_ids, False, None, False)


def test_completion_logprobs_hold_the_sampled_token_plus_the_best() -> None:
    lp = completion_logprobs(VOCAB, [SAMPLED_BEST, SAMPLED_ELSEWHERE], num_top=2)
    assert lp["tokens"] == [" Paris", "."]
    assert lp["token_logprobs"] == [-0.1, -4.0]
    # Up to logprobs + 1 entries: the sampled token first, then the best (each once).
    assert lp["top_logprobs"] == [{" Paris": -0.1, " London": -2.5},
                                  {".": -4.0, " Paris": -0.2, " London": -9999.0}]
    assert lp["text_offset"] == [0, 6]
    assert completion_logprobs(VOCAB, [SAMPLED_BEST], num_top=0)["top_logprobs"] == [
        {" Paris": -0.1}]


def test_completion_text_offsets_run_on_from_the_text_already_sent() -> None:
    assert completion_logprobs(VOCAB, [SAMPLED_ELSEWHERE, SAMPLED_BEST], 0,
                               initial_text_offset=10)["text_offset"] == [10, 11]


def test_chat_logprobs_list_the_first_candidates_with_their_bytes() -> None:
    content = chat_logprobs(VOCAB, [SAMPLED_BEST, TokenLogprob(5, -1.0, ((1, -0.5), (5, -1.0)))],
                            num_top=2)
    assert content == {"content": [
        {"token": " Paris", "logprob": -0.1, "bytes": [32, 80, 97, 114, 105, 115],
         "top_logprobs": [{"token": " Paris", "logprob": -0.1,
                           "bytes": [32, 80, 97, 114, 105, 115]},
                          {"token": " London", "logprob": -2.5,
                           "bytes": [32, 76, 111, 110, 100, 111, 110]}]},
        {"token": "é", "logprob": -1.0, "bytes": [195, 169],
         # vLLM's order: the sampled token first, even where it is not the best.
         "top_logprobs": [{"token": "é", "logprob": -1.0, "bytes": [195, 169]},
                          {"token": " Paris", "logprob": -0.5,
                           "bytes": [32, 80, 97, 114, 105, 115]}]}]}
    assert chat_logprobs(VOCAB, [SAMPLED_BEST], 0)["content"][0]["top_logprobs"] == []
    # Half a character is U+FFFD, whose UTF-8 is three bytes.
    assert chat_logprobs(VOCAB, [TokenLogprob(4, -1.0, ())], 0)["content"][0]["bytes"] == [
        239, 191, 189]


def test_stop_reasons_are_strings_for_stop_strings_and_ints_for_token_ids() -> None:
    chunk = Chunk((), "", (), "stop", "12")
    assert stop_reason(chunk, sampling(stop_token_ids=(12,))) == 12
    assert stop_reason(chunk, sampling(stop=("12",), stop_token_ids=(12,))) == "12"
    assert stop_reason(Chunk((), "", (), "stop", "END"), sampling(stop=("END",))) == "END"
    assert stop_reason(Chunk((), "", (), "stop"), sampling()) is None    # EOS


def test_usage_sums_the_choices() -> None:
    assert usage_body([Usage(5, 3, 2), Usage(7, 1, 0)]) == {
        "prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 2}}
