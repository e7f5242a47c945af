"""Two of vLLM's request options through the real services (issue 38, point 9), over gRPC and
over HTTP with the official `openai` client, streamed and not:

- `include_stop_str_in_output`: a greedy request whose stop string matches returns the text up
  to and including the stop string when the flag is on, and up to it when off (the default);
  both end with finish_reason "stop" and the stop string as the stop reason.
- an EBNF grammar (`guided_grammar`, `structured_outputs.grammar`, gRPC
  `StructuredOutput.grammar`): `root ::= "yes" | "no"` forces one of the two answers; a
  grammar xgrammar cannot parse is INVALID_ARGUMENT / a 400 naming the field.
"""

from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from services.rpc.splitserve.v1 import generation_pb2 as pb
from tests.e2e.harness import RunningCluster, run_cluster, stream_tokens
from tests.e2e.test_http_api import wait_for_http

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MAX_TOKENS = 24
GRAMMAR = 'root ::= "yes" | "no"'
QUESTION = "Is the sky green? Answer:"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("stop_grammar"), http=True) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.procs.http_address}/v1", api_key="none",
                         max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def free_text(cluster: RunningCluster) -> str:
    """The prompt's greedy continuation without stop strings (the reference for the cuts)."""
    once = cluster.stub.GenerateOnce(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=300)
    assert len(once.token_ids) == MAX_TOKENS and len(once.text) > 8, once.text
    return once.text


def stop_of(text: str) -> tuple[str, int]:
    """A stop string taken from the middle of `text`, and where it first occurs there."""
    stop = text[len(text) // 2:len(text) // 2 + 3]
    return stop, text.find(stop)


def test_grpc_keeps_the_stop_string_only_when_asked(cluster: RunningCluster,
                                                    free_text: str) -> None:
    stop, at = stop_of(free_text)
    for keep, expected in ((False, free_text[:at]), (True, free_text[:at + len(stop)])):
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                     stop=[stop])
        if keep:
            sampling.include_stop_str_in_output = True
        request = pb.GenerateRequest(text=PROMPT, sampling=sampling)
        _, text, last = stream_tokens(cluster.stub, request)
        assert (text, last.finish_reason, last.stop_reason) == (expected, "stop", stop)
        once = cluster.stub.GenerateOnce(request, timeout=300)
        assert (once.text, once.finish_reason) == (expected, "stop")


def test_http_keeps_the_stop_string_only_when_asked(client: openai.OpenAI,
                                                    free_text: str) -> None:
    stop, at = stop_of(free_text)
    for keep, expected in ((False, free_text[:at]), (True, free_text[:at + len(stop)])):
        extra: dict[str, Any] = {"ignore_eos": True}
        if keep:
            extra["include_stop_str_in_output"] = True
        response = client.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                             temperature=0, stop=[stop], extra_body=extra)
        choice = response.choices[0]
        assert (choice.text, choice.finish_reason) == (expected, "stop")
        usage = response.usage
        assert usage is not None and 0 < usage.completion_tokens <= MAX_TOKENS
        stream = client.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, stop=stop, stream=True,
                                           extra_body=extra)
        chunks = [c for c in stream if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_http_chat_keeps_the_stop_string(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    free = client.chat.completions.create(model="", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, temperature=0)
    full = free.choices[0].message.content or ""
    stop, at = stop_of(full)
    assert len(full) > 8 and at >= 0, full
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="", messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            temperature=0, stop=[stop], stream=stream,
            extra_body={"include_stop_str_in_output": True})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        else:
            text = reply.choices[0].message.content or ""   # type: ignore[union-attr]
        assert text == full[:at + len(stop)], (stop, text, full)


def test_grpc_grammar_forces_an_answer(cluster: RunningCluster) -> None:
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        request = pb.GenerateRequest(text=QUESTION, sampling=pb.SamplingParams(
            max_tokens=16, structured_output=pb.StructuredOutput(grammar=GRAMMAR),
            **sampling))  # type: ignore[arg-type]
        _, text, last = stream_tokens(cluster.stub, request)
        assert last.finish_reason == "stop" and text in ("yes", "no"), text


def test_grpc_refuses_a_grammar_it_cannot_parse(cluster: RunningCluster) -> None:
    for grammar in ('root ::= "yes" |', 'answer ::= "yes"'):
        request = pb.GenerateRequest(text=QUESTION, sampling=pb.SamplingParams(
            max_tokens=8, structured_output=pb.StructuredOutput(grammar=grammar)))
        with pytest.raises(grpc.RpcError) as refused:
            cluster.stub.GenerateOnce(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details() or ""
        assert details.startswith("structured_output.grammar does not compile"), details


def test_http_grammar_forces_an_answer(client: openai.OpenAI) -> None:
    response = client.completions.create(model="", prompt=QUESTION, max_tokens=16,
                                         temperature=0, extra_body={"guided_grammar": GRAMMAR})
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text in ("yes", "no"), response.choices[0].text
    messages = [{"role": "user", "content": "Is the sky green?"}]
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="", messages=messages, max_tokens=16,  # type: ignore[arg-type]
            temperature=1.0, seed=3, stream=stream,
            extra_body={"structured_outputs": {"grammar": GRAMMAR}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        else:
            text = reply.choices[0].message.content or ""   # type: ignore[union-attr]
        assert text in ("yes", "no"), text


def test_http_refuses_a_grammar_it_cannot_parse_by_field(client: openai.OpenAI) -> None:
    for extra, param in (({"guided_grammar": 'root ::= "yes" |'}, "guided_grammar"),
                         ({"structured_outputs": {"grammar": 'answer ::= "no"'}},
                          "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="", prompt=QUESTION, max_tokens=8,
                                      extra_body=extra)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == param, error
        assert "does not compile" in error["message"], error
