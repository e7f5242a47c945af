"""Sampling parameters end to end (issue 25, points 2 and 5): the penalties, logit_bias,
min_p, n and echo through the real services, over gRPC and through the official `openai`
client against the HTTP front end.

Greedy decoding with each penalty is compared token for token with HF transformers fp32 on
the same weights, its logits adjusted each step by the plain per-token reference of
tests/worker_svc/test_penalties.py; the HTTP text must equal the gRPC text."""

import json
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
import torch

from services.rpc.splitserve.v1 import generation_pb2 as pb
from services.wire import SamplingSpec
from tests.e2e.harness import HFOracle, RunningCluster, assert_matches_reference, run_cluster
from tests.e2e.test_http_api import wait_for_http
from tests.worker_svc.test_penalties import reference_adjust
from worker_svc.penalties import TokenHistory

pytestmark = pytest.mark.e2e

# Repetitive, so that every penalty changes the greedy continuation.
PROMPT = "one two three, one two three, one two three, one two"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("http-sampling"), http=True) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.procs.http_address}/v1", api_key="none",
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(cluster: RunningCluster) -> str:
    return str(cluster.stub.ModelInfo(pb.ModelInfoRequest()).model)


@pytest.fixture(scope="module")
def prompt_ids(cluster: RunningCluster) -> list[int]:
    return list(cluster.stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids)


@torch.inference_mode()
def penalized_greedy(oracle: HFOracle, prompt: list[int], spec: SamplingSpec,
                     max_tokens: int) -> tuple[list[int], list[float]]:
    """HF's logits, adjusted by the reference, argmax; (tokens, top-2 margins)."""
    ids = list(prompt)
    out = oracle.model(input_ids=torch.tensor([ids]), use_cache=True)
    tokens, margins = [], []
    for _ in range(max_tokens):
        adjusted = torch.tensor(reference_adjust(out.logits[0, -1].float().tolist(), spec,
                                                 TokenHistory(ids, len(prompt))))
        top2 = torch.topk(adjusted, 2)
        token = int(top2.indices[0])
        tokens.append(token)
        margins.append(float(top2.values[0] - top2.values[1]))
        ids.append(token)
        out = oracle.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                           use_cache=True)
    return tokens, margins


PENALTIES: dict[str, dict[str, Any]] = {
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 1.5},
    "repetition": {"repetition_penalty": 1.8},
    "logit_bias": {},              # filled in with the plain greedy's first token, banned
    "all": {"presence_penalty": -0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
}


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_each_penalty_matches_the_reference_over_grpc_and_http(
        name: str, cluster: RunningCluster, client: openai.OpenAI, model: str,
        oracle: HFOracle, prompt_ids: list[int]) -> None:
    plain = cluster.stub.GenerateOnce(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)),
        timeout=120)
    fields = dict(PENALTIES[name])
    bias: dict[int, float] = {}
    if name == "logit_bias":
        bias = {plain.token_ids[0]: -100.0, plain.token_ids[1]: -100.0}
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                               logit_bias=bias, **fields)
    ours = cluster.stub.GenerateOnce(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids), sampling=params), timeout=120)
    spec = SamplingSpec(0.0, 1.0, -1, None, None, min_p=0.0,
                        presence_penalty=params.presence_penalty,
                        frequency_penalty=params.frequency_penalty,
                        repetition_penalty=params.repetition_penalty or 1.0,
                        logit_bias=sorted(bias.items()))
    reference, margins = penalized_greedy(oracle, prompt_ids, spec, MAX_TOKENS)
    assert reference != list(plain.token_ids), "the penalty changes nothing here"
    assert_matches_reference(list(ours.token_ids), reference, margins, name)
    http = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0,
        logit_bias={str(t): v for t, v in bias.items()},  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, **{k: v for k, v in fields.items()
                                           if k == "repetition_penalty"}},
        **{k: v for k, v in fields.items() if k != "repetition_penalty"})
    assert http.choices[0].text == ours.text


def test_logit_bias_forces_a_token_and_min_p_one_is_greedy(
        cluster: RunningCluster, client: openai.OpenAI, model: str,
        prompt_ids: list[int]) -> None:
    forced = cluster.stub.GenerateOnce(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids), sampling=pb.SamplingParams(
            temperature=1.0, max_tokens=5, ignore_eos=True, logit_bias={42: 100.0})),
        timeout=120)
    assert list(forced.token_ids) == [42] * 5
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0)
    for seed in (1, 2):          # only the best token is left: any seed draws it
        only_best = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                              temperature=1.0, seed=seed,
                                              extra_body={"min_p": 1.0})
        assert only_best.choices[0].text == greedy.choices[0].text


def test_n_choices_are_distinct_reproducible_and_numbered(client: openai.OpenAI,
                                                          model: str) -> None:
    def choices(**fields: Any) -> list[str]:
        response = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                             temperature=1.0, n=3, **fields)
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert response.usage is not None and response.usage.completion_tokens == sum(
            len(c.logprobs.tokens) for c in response.choices)  # type: ignore[union-attr,arg-type]
        return [c.text for c in response.choices]

    seeded = choices(seed=123, logprobs=0)
    assert len(set(seeded)) == 3, seeded                 # choice i samples with seed + i
    assert choices(seed=123, logprobs=0) == seeded       # and each is reproducible
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                    temperature=1.0, seed=124)
    assert one.choices[0].text == seeded[1]

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
        temperature=1.0, seed=5, n=3, stream=True, stream_options={"include_usage": True})
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and all(texts.values()) and len(set(texts.values())) > 1
    assert usage is not None and usage.completion_tokens >= 3


def test_n_choices_share_the_prompts_cached_blocks(cluster: RunningCluster) -> None:
    block_size = cluster.stub.ServerInfo(pb.ServerInfoRequest()).replicas[0].block_size
    text = "A long and unique prompt about choices sharing blocks. " * 12
    finals: dict[int, pb.GenerateResponse] = {}
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in cluster.stub.Generate(pb.GenerateRequest(
            request_id="shared", text=text,
            sampling=pb.SamplingParams(temperature=1.0, seed=9, max_tokens=6, n=3,
                                       ignore_eos=True)), timeout=120):
        assert chunk.request_id == "shared"
        tokens[chunk.index] += chunk.token_ids
        if chunk.finish_reason:
            finals[chunk.index] = chunk
    assert sorted(finals) == [0, 1, 2] and all(len(t) == 6 for t in tokens.values())
    num_prompt = finals[0].usage.prompt_tokens
    assert num_prompt > 2 * block_size
    full_blocks = (num_prompt - 1) // block_size * block_size
    assert finals[0].usage.cached_prompt_tokens == 0           # a new prompt
    for index in (1, 2):
        usage = finals[index].usage
        # Choice 0's full blocks from the prefix cache; the KV store (on by default) may add
        # the prompt's partial tail it saved, up to every token but the last.
        assert usage.cached_prompt_tokens - usage.store_hit_tokens == full_blocks
        assert usage.cached_prompt_tokens <= num_prompt - 1


def test_echo_returns_the_prompt_first(client: openai.OpenAI, model: str) -> None:
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + greedy.choices[0].text
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                         temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_bad_sampling_values_are_400s_naming_the_field(client: openai.OpenAI, model: str,
                                                       cluster: RunningCluster) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"n": 65}, "n", "n must be in [1, 64]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "must be > 0"),
        ({"extra_body": {"min_p": 1.5}}, "min_p", "min_p must be in [0, 1]"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs",
         "not available with stream"),
    ]
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2, **fields)
        assert refused.value.param == param and message in refused.value.message, fields
    with pytest.raises(grpc.RpcError) as refused_grpc:
        cluster.stub.GenerateOnce(pb.GenerateRequest(
            text=PROMPT, sampling=pb.SamplingParams(n=2, max_tokens=2)), timeout=30)
    assert refused_grpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_abort_ends_every_choice(cluster: RunningCluster) -> None:
    stream = cluster.stub.Generate(pb.GenerateRequest(
        request_id="to-abort", text=PROMPT,
        sampling=pb.SamplingParams(temperature=1.0, max_tokens=2000, n=3, ignore_eos=True)),
        timeout=120)
    next(stream)                                             # running
    assert cluster.stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    reasons = {c.index: c.finish_reason for c in stream if c.finish_reason}
    assert reasons == {0: "abort", 1: "abort", 2: "abort"}


def test_chat_with_tools_and_text_parts_equals_the_grpc_chat(
        cluster: RunningCluster, client: openai.OpenAI, model: str) -> None:
    """Tools and tool messages go through (this model's template ignores tools), content
    parts are joined; the greedy reply is the gRPC API's for the same chat."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    reply = client.chat.completions.create(
        # tool_choice "none": the tools reach the template and the reply is text ("auto",
        # the default with tools, needs --enable-auto-tool-choice, as in vLLM).
        model=model, max_completion_tokens=8, temperature=0, tools=tools,  # type: ignore[arg-type]
        tool_choice="none",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Call f."},
                                               {"type": "text", "text": "Then answer."}]},
                  {"role": "assistant", "content": "", "tool_calls": [call]},  # type: ignore[list-item]
                  {"role": "tool", "content": "done", "tool_call_id": "c1"}])
    reference = cluster.stub.GenerateOnce(pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content="Call f.\nThen answer."),
                      pb.ChatMessage(role="assistant", tool_calls_json=json.dumps([call])),
                      pb.ChatMessage(role="tool", content="done", tool_call_id="c1")],
            tools_json=json.dumps(tools)),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=8)), timeout=120)
    assert reply.choices[0].message.content == reference.text and reference.text


@torch.inference_mode()
def test_prompt_logprobs_match_the_reference(cluster: RunningCluster,
                                             oracle: HFOracle) -> None:
    """Every prompt token's logprob, rank and top alternatives, against HF fp32; a second
    identical request (a prefix-cache hit otherwise) computes them all again; with n = 2 the
    other choice still reuses choice 0's blocks."""
    prompt_ids = list(cluster.stub.Tokenize(pb.TokenizeRequest(
        text="Prompt logprobs, " + PROMPT + " " + PROMPT)).token_ids)
    block_size = cluster.stub.ServerInfo(pb.ServerInfoRequest()).replicas[0].block_size
    assert len(prompt_ids) > block_size + 1
    reference = oracle.model(input_ids=torch.tensor([prompt_ids])).logits[0].float() \
        .log_softmax(dim=-1)                                          # [positions, vocab]
    for attempt in range(2):
        chunks = list(cluster.stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt_ids), sampling=pb.SamplingParams(
                temperature=0.0, max_tokens=3, prompt_logprobs=3, n=2)), timeout=120))
        firsts = {c.index: c for c in reversed(chunks)}
        assert not firsts[1].prompt_logprobs
        got = firsts[0].prompt_logprobs
        assert [lp.token_id for lp in got] == prompt_ids[1:], attempt
        for p, lp in enumerate(got):
            want = reference[p, prompt_ids[p + 1]].item()
            assert lp.logprob == pytest.approx(want, abs=2e-3), (attempt, p)
            rank = int((reference[p] > want + 2e-3).sum()) + 1
            assert rank <= lp.rank <= int((reference[p] > want - 2e-3).sum()) + 1
            values, _ = reference[p].topk(3)
            assert [t.logprob for t in lp.top] == pytest.approx(values.tolist(), abs=2e-3)
        finals = {c.index: c for c in chunks if c.finish_reason}
        assert finals[0].usage.cached_prompt_tokens == 0          # always computed
        assert finals[1].usage.cached_prompt_tokens == \
            (len(prompt_ids) - 1) // block_size * block_size


def test_prompt_logprobs_and_echo_with_logprobs_over_http(
        cluster: RunningCluster, client: openai.OpenAI, model: str,
        prompt_ids: list[int]) -> None:
    reference = cluster.stub.GenerateOnce(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)),
        timeout=120)
    assert len(reference.prompt_logprobs) == len(prompt_ids) - 1
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    entries = plain.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for entry, token_id, lp in zip(entries[1:], prompt_ids[1:], reference.prompt_logprobs):
        assert entry[str(token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
        assert entry[str(token_id)]["rank"] == lp.rank
        assert {int(t) for t in entry} == {token_id, *(t.token_id for t in lp.top)}
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                       temperature=0, echo=True, logprobs=1)
    lps = echoed.choices[0].logprobs
    assert lps is not None and lps.tokens is not None and lps.token_logprobs is not None
    assert len(lps.tokens) == len(prompt_ids) + 3
    assert lps.token_logprobs[0] is None
    assert lps.token_logprobs[1:len(prompt_ids)] == pytest.approx(
        [lp.logprob for lp in reference.prompt_logprobs], abs=1e-5)
    assert echoed.choices[0].text == PROMPT + reference.text
    streamed = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                              temperature=0, echo=True, logprobs=1,
                                              stream=True))
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert tokens == lps.tokens


def test_prompt_logprobs_over_chunked_prefill_equal_the_unchunked(
        cluster: RunningCluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A prompt spread over several steps (a 16-token budget) gathers the same prompt
    logprobs as one computed in a single step."""
    text = "Chunks of a prompt, " + PROMPT + " " + PROMPT
    request = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=2, prompt_logprobs=1))
    whole = cluster.stub.GenerateOnce(request, timeout=120)
    assert len(whole.prompt_logprobs) > 32
    with run_cluster(tmp_path_factory.mktemp("chunked"),
                     scheduler_args=("--max-num-batched-tokens", "16")) as chunked:
        parts = chunked.stub.GenerateOnce(request, timeout=120)
    assert [lp.token_id for lp in parts.prompt_logprobs] == \
        [lp.token_id for lp in whole.prompt_logprobs]
    assert [lp.logprob for lp in parts.prompt_logprobs] == pytest.approx(
        [lp.logprob for lp in whole.prompt_logprobs], abs=2e-3)
    assert [lp.top[0].token_id for lp in parts.prompt_logprobs] == \
        [lp.top[0].token_id for lp in whole.prompt_logprobs]
    assert parts.token_ids == whole.token_ids
