"""Generation's servicer as a thin adapter over the front end's core: a whole generation through
GenerateOnce (text, usage), the core's exceptions as status codes (a request a replica refuses
is INVALID_ARGUMENT), Abort relayed through the cluster when other front ends may hold the
request, and ServerInfo from the cluster's statistics. Driven directly, no server or network."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from scheduler_svc.cluster.wire import ClusterStatsReply, FrontendReport, ReplicaInfo, WorkerInfo
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.wire import EngineStats
from scheduler_svc.frontend.core import (
    Draining,
    Frontend,
    QueueFull,
    RequestFailed,
)
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.prompts import PreparedRequest
from scheduler_svc.frontend.servicer import GenerationServicer
from scheduler_svc.frontend.streams import RequestOutput
from scheduler_svc.frontend.tokenizer import TextTokenizer
from scheduler_svc.frontend.validation import InvalidRequest
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import generation_pb2
from tests.scheduler_svc.frontend.fakes import (
    FakeEngineLinks,
    cluster_state,
    finished,
    replica,
    settle,
    step_message,
)
from tests.scheduler_svc.grpc_context import Aborted, FakeContext


def test_generate_once_returns_the_whole_output_and_its_usage(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer,
        model_path: Path) -> None:
    servicer = GenerationServicer(frontend, load_model_config(model_path), SchedulerConfig())
    tokens = tokenizer.encode(" one two three")
    a = replica(0)
    request = generation_pb2.GenerateRequest(
        request_id="r", token_ids=generation_pb2.TokenIds(ids=[5, 6]),
        sampling=generation_pb2.SamplingParams(max_tokens=len(tokens)))

    async def engine() -> None:
        while not links.requests():
            await asyncio.sleep(0.001)
        ((_, sent),) = links.requests()
        for i, token in enumerate(tokens, start=1):
            ending = [finished(sent.handle, "length", 2, i, num_cached_tokens=1)]
            frontend.take_outputs(step_message(a, [(sent.handle, token)],
                                               ending if i == len(tokens) else []))
            await settle()

    async def run() -> generation_pb2.GenerateResponse:
        frontend.take_state(cluster_state(a))
        answer, _ = await asyncio.gather(
            servicer.GenerateOnce(request, FakeContext()),  # type: ignore[arg-type]
            engine())
        return answer

    answer = asyncio.run(run())
    assert (answer.request_id, list(answer.token_ids), answer.text) == (
        "r", tokens, " one two three")
    assert answer.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens,
            answer.usage.cached_prompt_tokens) == (2, len(tokens), 1)


class FailingFrontend:
    """Takes the request; then generating it raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def check_room(self, client: str) -> None:
        pass

    async def prepare(self, *_: object) -> PreparedRequest:
        return PreparedRequest("r", [1, 2], SamplingParams())

    async def generate(self, prepared: PreparedRequest, time_remaining: float | None,
                       whole: bool = False) -> AsyncIterator[RequestOutput]:
        raise self.error
        yield  # an async generator, like Frontend.generate


@pytest.mark.parametrize("error, code", [
    (InvalidRequest("the pool holds 16 tokens"), grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull("9 requests are live"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Draining("the server is draining"), grpc.StatusCode.UNAVAILABLE),
    (RequestFailed("replica lost"), grpc.StatusCode.UNAVAILABLE),
    (RequestFailed("a step failed", server_fault=True), grpc.StatusCode.INTERNAL),
])
def test_the_cores_errors_are_status_codes(model_path: Path, error: Exception,
                                           code: grpc.StatusCode) -> None:
    servicer = GenerationServicer(FailingFrontend(error),  # type: ignore[arg-type]
                                  load_model_config(model_path), SchedulerConfig())
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2]))
    with pytest.raises(Aborted) as refused:
        asyncio.run(servicer.GenerateOnce(request, FakeContext()))  # type: ignore[arg-type]
    assert refused.value.code == code and str(error) in refused.value.details


def test_a_client_past_its_share_is_refused_before_tokenizing(
        frontend: Frontend, model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood's calls past its share of the live requests cost no tokenizing: the servicer
    asks the core for room first."""
    servicer = GenerationServicer(frontend, load_model_config(model_path), SchedulerConfig())
    frontend.max_live_requests = 4                        # one client may hold 3
    prepared: list[str] = []
    real_prepare = frontend.prepare

    async def counting_prepare(*args: object, **kwargs: object) -> PreparedRequest:
        prepared.append(str(args[0]))
        return await real_prepare(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(frontend, "prepare", counting_prepare)
    monkeypatch.setattr(frontend.live, "num_of", lambda client: 3 if client == "flood" else 0)
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2]))
    flood = FakeContext()
    flood.invocation_metadata = lambda: (("splitserve-client", "flood"),)  # type: ignore[method-assign]
    with pytest.raises(Aborted) as refused:
        asyncio.run(servicer.GenerateOnce(request, flood))  # type: ignore[arg-type]
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "this client has 3 requests live" in refused.value.details
    assert prepared == []


class FakeClusterLink:
    """What the servicer uses of links.ClusterLink."""

    def __init__(self, found_elsewhere: bool = False,
                 stats: ClusterStatsReply | None = None) -> None:
        self.found_elsewhere = found_elsewhere
        self.asked: list[str] = []
        self.owners: list[str] = []
        self.reports: list[FrontendReport] = []
        self._stats = stats

    async def abort_elsewhere(self, request_id: str, timeout_s: float = 1.0,
                              owner: str = "") -> bool:
        self.asked.append(request_id)
        self.owners.append(owner)
        return self.found_elsewhere

    async def stats(self, report: FrontendReport) -> ClusterStatsReply | None:
        self.reports.append(report)
        return self._stats


def abort(servicer: GenerationServicer, request_id: str) -> bool:
    response = asyncio.run(servicer.Abort(generation_pb2.AbortRequest(request_id=request_id),
                                          FakeContext()))  # type: ignore[arg-type]
    return response.found


def test_abort_asks_the_other_front_ends_only_when_there_are_some(
        frontend: Frontend, model_path: Path) -> None:
    model = load_model_config(model_path)
    alone = FakeClusterLink(found_elsewhere=True)
    assert not abort(GenerationServicer(frontend, model, SchedulerConfig(),
                                        alone),  # type: ignore[arg-type]
                     "r")
    assert alone.asked == []
    shared = FakeClusterLink(found_elsewhere=True)
    servicer = GenerationServicer(frontend, model, SchedulerConfig(),
                                  shared, num_frontends=3)  # type: ignore[arg-type]
    assert abort(servicer, "r") and shared.asked == ["r"]
    # Another front end's query reaches this one through the link's callback.
    assert shared.on_abort("nobody") is False  # type: ignore[attr-defined]


def test_server_info_comes_from_the_cluster(frontend: Frontend, model_path: Path) -> None:
    engine = EngineStats(
        num_kv_blocks=65, num_usable_blocks=64, num_free_blocks=60, num_running=2,
        num_waiting=1, num_preemptions=0, num_steps=10, num_kv_recoveries=0, kv_ok=True,
        forward_gap_ms_total=0.0, num_forward_gaps=0, num_prompt_tokens_admitted=100,
        num_cached_tokens_admitted=25)
    stats = ClusterStatsReply(
        replicas=[ReplicaInfo(0, "ready", "float32",
                              [WorkerInfo("w0", 1, 0, 0, "cpu", 65, "ready", "avx2")], engine)],
        num_migrations=1, num_parked=2, num_requests_total=7, kv_reachable=True)
    sched = SchedulerConfig(block_size=16)
    link = FakeClusterLink(stats=stats)
    servicer = GenerationServicer(frontend, load_model_config(model_path), sched,
                                  link)  # type: ignore[arg-type]
    info = asyncio.run(servicer.ServerInfo(generation_pb2.ServerInfoRequest(),
                                           FakeContext()))  # type: ignore[arg-type]
    assert (info.num_requests_total, info.num_migrations, info.num_parked) == (7, 1, 2)
    assert info.prefix_cache_hit_rate == 0.25 and info.kvcache_reachable
    (r,) = info.replicas
    assert (r.replica_id, r.state, r.block_size, r.num_free_blocks, r.num_running) == (
        0, "ready", 16, 60, 2)
    assert [w.worker_id for w in r.workers] == ["w0"]
    assert link.reports == [frontend.report()]
    silent = GenerationServicer(frontend, load_model_config(model_path), sched,
                                FakeClusterLink())  # type: ignore[arg-type]
    with pytest.raises(Aborted) as refused:
        asyncio.run(silent.ServerInfo(generation_pb2.ServerInfoRequest(),
                                      FakeContext()))  # type: ignore[arg-type]
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
