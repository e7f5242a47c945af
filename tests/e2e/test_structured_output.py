"""Structured output through the real services (issue 25, point 3): a JSON schema, any JSON
object, a regex and a choice, over gRPC and over HTTP with the official `openai` client,
greedy and with temperature sampling; the output always parses against its constraint and
ends with "stop", and greedy tokens are HF transformers' under the same grammar. The
scheduler runs with async scheduling (a constrained request waits for its own token before
its next step; a free one beside it runs ahead). Bad constraints are INVALID_ARGUMENT / 400
naming the field. One more cluster with two pipeline stages: the masks reach the last stage
only, and the output still parses."""

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
import xgrammar as xgr

from scheduler_svc.frontend.grammar import Grammars
from scheduler_svc.frontend.structured_output import OutputKind, StructuredOutput
from scheduler_svc.frontend.tokenizer import ChatMessage
from services.rpc.splitserve.v1 import generation_pb2 as pb
from tests.e2e.harness import (
    HFOracle,
    RunningCluster,
    assert_matches_reference,
    run_cluster,
    stream_tokens,
)
from tests.e2e.test_http_api import wait_for_http

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe not"]
PROMPT = "Describe a person as JSON with a name, an age and a city:"
EOS_ID = 2                  # <|im_end|>, the default model's EOS
SAMPLINGS = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1234}]


def check_schema(text: str) -> None:
    """The text is JSON that the schema above accepts (every rule of it checked by hand)."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "age", "city"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 12, text
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120, text
    assert value["city"] in ("Paris", "London", "Rome"), text


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("structured"), http=True,
                     scheduler_args=["--async-scheduling"]) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.procs.http_address}/v1", api_key="none",
                         max_retries=0, timeout=300)


def grpc_request(structured: pb.StructuredOutput, prompt: str = PROMPT, max_tokens: int = 96,
                 **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
        max_tokens=max_tokens, structured_output=structured, **sampling))


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "temperature"])
def test_grpc_outputs_follow_their_constraint(cluster: RunningCluster,
                                              sampling: dict[str, Any]) -> None:
    stub = cluster.stub
    _, text, last = stream_tokens(stub, grpc_request(
        pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), **sampling))
    assert last.finish_reason == "stop"
    check_schema(text)
    _, text, last = stream_tokens(stub, grpc_request(
        pb.StructuredOutput(regex=REGEX), "Call me at", 32, **sampling))
    assert last.finish_reason == "stop" and re.fullmatch(REGEX, text), text
    _, text, last = stream_tokens(stub, grpc_request(
        pb.StructuredOutput(choice=CHOICES), "Is the sky green? Answer:", 16, **sampling))
    assert last.finish_reason == "stop" and text in CHOICES, text
    once = stub.GenerateOnce(grpc_request(pb.StructuredOutput(json_object=True),
                                          "A JSON object with one key:", 64, **sampling),
                             timeout=300)
    if once.finish_reason == "stop":     # any JSON object may run past max_tokens
        assert isinstance(json.loads(once.text), dict), once.text
    else:
        assert once.finish_reason == "length" and once.text.lstrip().startswith("{")


def test_a_free_request_beside_constrained_ones_is_unchanged(cluster: RunningCluster) -> None:
    """The free request's greedy tokens are the same alone and beside three constrained ones
    (a mask touches only its own row)."""
    stub = cluster.stub
    free = pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True))
    alone = stub.GenerateOnce(free, timeout=300).token_ids
    constrained = [grpc_request(pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
                                temperature=0.0),
                   grpc_request(pb.StructuredOutput(regex=REGEX), "Call me at", 32,
                                temperature=0.0),
                   grpc_request(pb.StructuredOutput(choice=CHOICES), "Yes or no?", 16,
                                temperature=0.0)]
    with ThreadPoolExecutor(4) as pool:
        beside = pool.submit(stub.GenerateOnce, free, timeout=300)
        others = [pool.submit(stub.GenerateOnce, r, timeout=300) for r in constrained]
        assert list(beside.result().token_ids) == list(alone)
        texts = [f.result().text for f in others]
    check_schema(texts[0])
    assert re.fullmatch(REGEX, texts[1]) and texts[2] in CHOICES, texts


@pytest.mark.parametrize("structured, field", [
    (pb.StructuredOutput(json_schema='{"type": "bogus"}'), "structured_output.json_schema"),
    (pb.StructuredOutput(json_schema="{nope"), "structured_output.json_schema"),
    (pb.StructuredOutput(regex="([a-"), "structured_output.regex"),
    (pb.StructuredOutput(regex="a+", choice=["a"]), "structured_output"),
])
def test_grpc_refuses_bad_constraints_by_field(cluster: RunningCluster,
                                               structured: pb.StructuredOutput,
                                               field: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        cluster.stub.GenerateOnce(grpc_request(structured), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(field), refused.value.details()


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "temperature"])
def test_openai_client_chat_json_schema(client: openai.OpenAI,
                                        sampling: dict[str, Any]) -> None:
    response = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": PROMPT}], max_tokens=96,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA}}, **sampling)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    check_schema(choice.message.content or "")
    stream = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": PROMPT}], max_tokens=96, stream=True,
        extra_body={"guided_json": SCHEMA}, **sampling)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check_schema(text)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "temperature"])
def test_openai_client_completions_regex_and_choice(client: openai.OpenAI,
                                                    sampling: dict[str, Any]) -> None:
    response = client.completions.create(model="", prompt="Call me at", max_tokens=32,
                                         extra_body={"guided_regex": REGEX}, **sampling)
    assert response.choices[0].finish_reason == "stop"
    assert re.fullmatch(REGEX, response.choices[0].text), response.choices[0].text
    response = client.completions.create(model="", prompt="Is the sky green? Answer:",
                                         max_tokens=16, extra_body={"guided_choice": CHOICES},
                                         **sampling)
    assert response.choices[0].text in CHOICES


def test_openai_client_json_object_and_structured_outputs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Give me a JSON object."}],
        max_tokens=64, temperature=0, response_format={"type": "json_object"})
    choice = response.choices[0]
    if choice.finish_reason == "stop":       # any JSON object may run past max_tokens
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert (choice.message.content or "").lstrip().startswith("{")
    response = client.completions.create(
        model="", prompt="Is the sky green? Answer:", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"choice": CHOICES}})
    assert response.choices[0].text in CHOICES
    response = client.completions.create(
        model="", prompt="Call me at", max_tokens=32, temperature=0,
        extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, response.choices[0].text), response.choices[0].text


def test_openai_client_bad_schema_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "response_format", error
    assert "does not compile" in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="", prompt="x", max_tokens=8,
                                  extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert refused.value.body["param"] == "guided_choice"      # type: ignore[index]


def test_pipeline_stages_follow_the_constraint(tmp_path: Path) -> None:
    """Two stages (the batch queue keeps two steps in flight): only the last stage gets the
    masks, and the output parses; greedy and sampled."""
    with run_cluster(tmp_path, pp=2) as cluster:
        for sampling in SAMPLINGS:
            _, text, last = stream_tokens(cluster.stub, grpc_request(
                pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), **sampling))
            assert last.finish_reason == "stop"
            check_schema(text)
            _, text, _ = stream_tokens(cluster.stub, grpc_request(
                pb.StructuredOutput(choice=CHOICES), "Yes or no?", 16, **sampling))
            assert text in CHOICES


@torch.inference_mode()
def hf_constrained_greedy(oracle: HFOracle, grammar: Any, vocab_size: int,
                          prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """HF transformers' greedy tokens under the grammar, masked with xgrammar's own CPU
    kernel (not ours), until the grammar is complete; with each step's top-1 minus top-2
    margin among the allowed tokens (inf where only one is allowed)."""
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    out = oracle.model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(max_tokens):
        logits = out.logits[0, -1:].float().clone()                 # [1, vocab]
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        top2 = torch.topk(logits[0], 2)
        tokens.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        assert matcher.accept_token(tokens[-1])
        if matcher.is_terminated():
            break
        out = oracle.model(input_ids=top2.indices[:1].view(1, 1),
                           past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


def test_greedy_constrained_tokens_match_hf_under_the_same_grammar(
        cluster: RunningCluster, oracle: HFOracle, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Greedy outputs stay token-exact against HF transformers (fp32), now under a grammar."""
    grammars = Grammars(tokenizer, oracle.model.config.vocab_size, (EOS_ID,))
    prompt = tokenizer.encode(tokenizer.render_chat([ChatMessage("user", PROMPT)], True))
    cases = [(StructuredOutput(OutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
              pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
             (StructuredOutput(OutputKind.REGEX, REGEX), pb.StructuredOutput(regex=REGEX)),
             (StructuredOutput(OutputKind.CHOICE, choices=tuple(CHOICES)),
              pb.StructuredOutput(choice=CHOICES))]
    for spec, message in cases:
        compiled = grammars.compile(spec)       # as the engine core gets it: serialized
        grammar = xgr.CompiledGrammar.deserialize_json(
            compiled.serialized.decode(),
            xgr.TokenizerInfo.deserialize_json(grammars.vocabulary().decode()))
        ref, margins = hf_constrained_greedy(oracle, grammar, oracle.model.config.vocab_size,
                                             prompt, 96)
        assert ref[-1] == EOS_ID, "the reference did not complete its grammar"
        ours = cluster.stub.GenerateOnce(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                temperature=0.0, max_tokens=96, structured_output=message)), timeout=300)
        assert ours.finish_reason == "stop"
        assert_matches_reference(list(ours.token_ids), ref, margins, spec.kind.value)
