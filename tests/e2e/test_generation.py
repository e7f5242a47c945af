"""The running multi-process system (kvcache_svc + scheduler_svc + worker_svc, default flags)
against HF transformers, plus the public API's behaviour over real gRPC."""

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.conftest import MAX_TOKENS, QUESTIONS
from tests.e2e.harness import (
    RunningCluster,
    assert_matches_reference,
    greedy_request,
    stream_tokens,
    wait_for,
)

pytestmark = pytest.mark.e2e


def run_all(cluster: RunningCluster, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
            ) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_tokens, cluster.stub, greedy_request(p, max_tokens))
                   for p in prompts]
        return [f.result()[0] for f in futures]


def test_single_prompt_matches_hf(cluster, prompts, references) -> None:  # type: ignore[no-untyped-def]
    ids, text, last = stream_tokens(cluster.stub, greedy_request(prompts[0], MAX_TOKENS))
    assert_matches_reference(ids, *references[0], label="prompt 0")
    assert last.finish_reason == "length"
    assert last.usage.prompt_tokens == len(prompts[0])
    assert last.usage.completion_tokens == MAX_TOKENS
    assert text and "\ufffd" not in text


def test_chat_input_renders_template(cluster, prompts, references) -> None:  # type: ignore[no-untyped-def]
    request = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[
            generation_pb2.ChatMessage(role="user", content=QUESTIONS[0])]),
        sampling=generation_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True))
    ids, _, last = stream_tokens(cluster.stub, request)
    assert last.usage.prompt_tokens == len(prompts[0])
    assert_matches_reference(ids, *references[0], label="chat prompt 0")


def test_16_concurrent_prompts_match_hf(cluster, prompts, references) -> None:  # type: ignore[no-untyped-def]
    outputs = run_all(cluster, prompts)
    notes = [assert_matches_reference(o, *r, label=f"prompt {i}")
             for i, (o, r) in enumerate(zip(outputs, references))]
    print("\n".join(n for n in notes if n))


def test_prefix_cache_same_prompt_twice(cluster, prompts, references) -> None:  # type: ignore[no-untyped-def]
    first = stream_tokens(cluster.stub, greedy_request(prompts[3], MAX_TOKENS))
    second = stream_tokens(cluster.stub, greedy_request(prompts[3], MAX_TOKENS))
    assert second[2].usage.cached_prompt_tokens > 0, "second run should hit the prefix cache"
    assert second[0] == first[0]
    assert_matches_reference(second[0], *references[3], label="cached prompt 3")


def test_prefix_cache_shared_system_prompt(cluster, tokenizer, oracle) -> None:  # type: ignore[no-untyped-def]
    from scheduler_svc.frontend.tokenizer import ChatMessage

    system = ("You are a meticulous assistant for a public library. Answer briefly, cite the "
              "shelf when you can, and never invent a book that does not exist.")
    prompts = [tokenizer.encode(tokenizer.render_chat(
        [ChatMessage("system", system), ChatMessage("user", q)], True)) for q in QUESTIONS[:4]]
    stream_tokens(cluster.stub, greedy_request(prompts[0], 4))   # warm the shared prefix
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: stream_tokens(cluster.stub, greedy_request(p, 16)),
                                prompts[1:]))
    for i, (ids, _, last) in enumerate(results, start=1):
        assert last.usage.cached_prompt_tokens >= 16, "system prompt blocks should be reused"
        assert_matches_reference(ids, *oracle.greedy(prompts[i], 16), label=f"system {i}")


def test_prefix_cache_salt_separates_tenants(cluster, prompts) -> None:  # type: ignore[no-untyped-def]
    """One prompt unsalted (cached from now on), then under salt A (no hit on the unsalted
    blocks), under A again (a hit), then under salt B (no hit: B cannot see what A sent).
    Salts are fresh per run, so nothing else warmed them."""
    salt_a, salt_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"

    def run(salt: str) -> tuple[list[int], str, generation_pb2.GenerateResponse]:
        request = greedy_request(prompts[7], 8)
        request.cache_salt = salt
        return stream_tokens(cluster.stub, request)

    unsalted = run("")
    first, second, other = run(salt_a), run(salt_a), run(salt_b)
    assert first[2].usage.cached_prompt_tokens == 0, "salt A must not hit unsalted blocks"
    assert second[2].usage.cached_prompt_tokens > 0, "same salt should hit the prefix cache"
    assert other[2].usage.cached_prompt_tokens == 0, "salt B must not hit salt A's blocks"
    assert unsalted[0] == first[0] == second[0] == other[0]


def test_bad_input_table_while_others_stream(cluster, prompts) -> None:  # type: ignore[no-untyped-def]
    P = generation_pb2
    ok_ids = prompts[0]

    def req(**kw: object) -> generation_pb2.GenerateRequest:
        sampling = kw.pop("sampling", P.SamplingParams(max_tokens=4))
        r = P.GenerateRequest(sampling=sampling, **kw)  # type: ignore[arg-type]
        if not any(r.HasField(f) for f in ("text", "token_ids", "chat")):
            r.token_ids.ids.extend(ok_ids)
        return r

    table = [
        ("empty prompt", P.GenerateRequest(text="", sampling=P.SamplingParams(max_tokens=4)),
         "prompt is empty"),
        ("prompt longer than context", req(token_ids=P.TokenIds(ids=[5] * 8200)),
         "context is 8192 tokens"),
        ("max_tokens 0", req(sampling=P.SamplingParams(max_tokens=0)), "max_tokens must be"),
        ("max_tokens negative", req(sampling=P.SamplingParams(max_tokens=-5)),
         "max_tokens must be"),
        ("max_tokens beyond context", req(sampling=P.SamplingParams(max_tokens=9000)),
         "exceeds the model's context"),
        ("temperature < 0", req(sampling=P.SamplingParams(temperature=-1)),
         "temperature must be >= 0"),
        ("top_p 0", req(sampling=P.SamplingParams(top_p=0)), "top_p must be in"),
        ("top_p > 1", req(sampling=P.SamplingParams(top_p=1.5)), "top_p must be in"),
        ("top_k < -1", req(sampling=P.SamplingParams(top_k=-2)), "top_k must be"),
        ("token id outside vocab", req(token_ids=P.TokenIds(ids=[1, 49152])),
         "outside the vocabulary"),
        ("unknown model", req(model="gpt-9"), "unknown model 'gpt-9'"),
        ("no input", P.GenerateRequest(sampling=P.SamplingParams(max_tokens=4)),
         "set exactly one of text, token_ids, chat (got none)"),
        ("both text and token ids", req(text="hi", token_ids=P.TokenIds(ids=[1, 2])),
         "(got text and token_ids)"),
        ("cache_salt too long", req(cache_salt="s" * 257),
         "cache_salt is 257 bytes of UTF-8; at most 256"),
    ]

    done = threading.Event()
    background: list[object] = []

    def long_stream() -> None:
        background.append(stream_tokens(cluster.stub, greedy_request(prompts[5], 48)))
        done.set()

    t = threading.Thread(target=long_stream)
    t.start()
    for name, request, message in table:
        with pytest.raises(grpc.RpcError) as info:
            list(cluster.stub.Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert message in info.value.details(), f"{name}: {info.value.details()}"
        with pytest.raises(grpc.RpcError) as info:
            cluster.stub.GenerateOnce(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    t.join(timeout=300)
    assert done.is_set() and len(background[0][0]) == 48  # type: ignore[index]


def test_duplicate_live_request_id(cluster, prompts) -> None:  # type: ignore[no-untyped-def]
    stream = cluster.stub.Generate(greedy_request(prompts[1], 200, request_id="dup"))
    next(iter(stream))
    with pytest.raises(grpc.RpcError) as info:
        cluster.stub.GenerateOnce(greedy_request(prompts[1], 4, request_id="dup"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in use" in info.value.details()
    assert cluster.stub.Abort(generation_pb2.AbortRequest(request_id="dup")).found
    chunks = list(stream)
    assert chunks[-1].finish_reason == "abort"


def test_cancelled_stream_aborts_and_frees_blocks(cluster, prompts) -> None:  # type: ignore[no-untyped-def]
    stream = cluster.stub.Generate(greedy_request(prompts[2], 2000))
    it = iter(stream)
    next(it)
    next(it)
    assert any(p.num_used_blocks > 0 for p in cluster.kv_stats().pools)
    stream.cancel()
    freed = wait_for(lambda: all(p.num_used_blocks == 0 for p in cluster.kv_stats().pools), 20)
    assert freed, f"blocks still held after cancel: {cluster.kv_stats()}"
    # The replica's counts are a snapshot its engine takes once per loop, after kvcache_svc
    # has freed the blocks: under load it may lag them by a moment.
    gone = wait_for(lambda: cluster.stub.ServerInfo(
        generation_pb2.ServerInfoRequest()).replicas[0].num_running == 0, 10)
    assert gone, "the cancelled request still counts as running"


def test_generate_once_equals_stream(cluster, prompts) -> None:  # type: ignore[no-untyped-def]
    ids, text, _ = stream_tokens(cluster.stub, greedy_request(prompts[4], 12))
    once = cluster.stub.GenerateOnce(greedy_request(prompts[4], 12), timeout=120)
    assert list(once.token_ids) == ids and once.text == text
    assert once.finish_reason == "length" and once.usage.completion_tokens == 12


def test_stop_string_not_in_output(cluster, prompts, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids, text, _ = stream_tokens(cluster.stub, greedy_request(prompts[0], MAX_TOKENS))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = full.split()[2]                      # the third word of the greedy answer
    _, text2, last = stream_tokens(cluster.stub, greedy_request(
        prompts[0], MAX_TOKENS, stop=[stop]))
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert stop not in text2 and full.startswith(text2)


def test_eos_and_stop_token_ids(cluster, prompts) -> None:  # type: ignore[no-untyped-def]
    ids, _, _ = stream_tokens(cluster.stub, greedy_request(prompts[0], MAX_TOKENS))
    r = greedy_request(prompts[0], MAX_TOKENS, stop_token_ids=[ids[3]])
    ids2, _, last = stream_tokens(cluster.stub, r)
    assert ids2 == ids[:ids.index(ids[3]) + 1] and last.finish_reason == "stop"
    # Without ignore_eos the chat answer ends at <|im_end|> (id 2) before 200 tokens.
    r = greedy_request(prompts[0], 200)
    r.sampling.ignore_eos = False
    ids3, text3, last = stream_tokens(cluster.stub, r)
    assert last.finish_reason == "stop" and ids3[-1] == 2 and "<|im_end|>" not in text3


def test_seeded_sampling_and_logprobs(cluster, prompts) -> None:  # type: ignore[no-untyped-def]
    def sampled(seed: int) -> generation_pb2.GenerateResponse:
        r = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompts[6]),
            sampling=generation_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                   seed=seed, max_tokens=16, ignore_eos=True,
                                                   logprobs=3))
        return cluster.stub.GenerateOnce(r, timeout=120)

    a, b, c = sampled(1), sampled(1), sampled(2)
    assert list(a.token_ids) == list(b.token_ids)
    assert list(a.token_ids) != list(c.token_ids)
    assert len(a.logprobs) == 16
    for tok, lp in zip(a.token_ids, a.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_tokenize_model_and_server_info(cluster, tokenizer, prompts) -> None:  # type: ignore[no-untyped-def]
    t = cluster.stub.Tokenize(generation_pb2.TokenizeRequest(text="Hello world"))
    assert list(t.token_ids) == tokenizer.encode("Hello world")
    chat = cluster.stub.Tokenize(generation_pb2.TokenizeRequest(
        chat=generation_pb2.ChatMessages(messages=[
            generation_pb2.ChatMessage(role="user", content=QUESTIONS[0])])))
    assert list(chat.token_ids) == prompts[0] and chat.prompt.endswith("assistant\n")
    info = cluster.stub.ModelInfo(generation_pb2.ModelInfoRequest())
    assert (info.vocab_size, info.max_model_len, info.num_layers) == (49152, 8192, 30)
    assert info.has_chat_template and list(info.eos_token_ids) == [2]
    server = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest())
    assert len(server.replicas) == 1 and server.replicas[0].state == "ready"
    assert server.replicas[0].workers[0].state == "ready"
    assert server.replicas[0].num_kv_blocks > 1 and server.chunked_prefill


def test_health_liveness_and_readiness(cluster) -> None:  # type: ignore[no-untyped-def]
    stub = health_pb2_grpc.HealthStub(cluster.channel)
    for service in ("", "splitserve.v1.Generation"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


REFLECTION_CLIENT = r'''
import sys, grpc
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf import message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

assert not any(m.startswith("services") for m in sys.modules)
channel = grpc.insecure_channel(sys.argv[1])
pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
method = pool.FindServiceByName("splitserve.v1.Generation").FindMethodByName("Generate")
Request = message_factory.GetMessageClass(method.input_type)
Response = message_factory.GetMessageClass(method.output_type)
generate = channel.unary_stream("/splitserve.v1.Generation/Generate",
                                request_serializer=Request.SerializeToString,
                                response_deserializer=Response.FromString)
request = Request(text="The capital of France is")
request.sampling.max_tokens = 5
request.sampling.temperature = 0
chunks = list(generate(request, timeout=120))
print(sum(len(c.token_ids) for c in chunks), chunks[-1].finish_reason)
'''


def test_reflection_only_client_calls_generate(cluster) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", REFLECTION_CLIENT, cluster.procs.address],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "length"]
