"""The null worker (`python -m worker_svc --null-model`, worker_svc.null_runner) through the
real services: greedy outputs are the null model's deterministic tokens, and EOS ends the
requests of the EOS share at the EOS step. The worker emulates a 2 ms device and launches
ahead, as on a GPU."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.harness import greedy_request, run_cluster, stream_tokens
from worker_svc.null_sampler import echo_token, ends_early

EOS_STEP = 4
EOS_SHARE = 0.5
MAX_TOKENS = 10
# Token ids of the default model's vocabulary, EOS ids (2 is <|im_end|>) among them.
PROMPTS = [[504, 3575, 2, 282, 4649, 314], [1604, 3987, 46477, 24, 94, 727, 2],
           [6403, 1980, 253, 655], [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198]]
REQUEST_IDS = [f"null-{i}" for i in range(8)]


def expected(prompt: list[int], request_id: str, eos_token_ids: list[int]) -> list[int]:
    """The null model's tokens for one request, EOS ignored (its EOS: the model's first)."""
    return [eos_token_ids[0] if i == EOS_STEP - 1 and ends_early(request_id, EOS_SHARE)
            else echo_token(prompt, i, frozenset(eos_token_ids), 0) for i in range(MAX_TOKENS)]


@pytest.mark.e2e
def test_null_worker_tokens_and_eos_share(tmp_path: Path) -> None:
    early = [rid for rid in REQUEST_IDS if ends_early(rid, EOS_SHARE)]
    assert 0 < len(early) < len(REQUEST_IDS)          # both kinds are exercised
    worker_args = ("--null-model", "--null-step-ms", "2", "--null-eos-step", str(EOS_STEP),
                   "--null-eos-share", str(EOS_SHARE))
    with run_cluster(tmp_path, worker_args=worker_args) as cluster:
        info = cluster.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
        eos_ids = list(info.eos_token_ids)
        assert 2 in eos_ids

        def one(i: int, ignore_eos: bool) -> tuple[list[int], str]:
            request = greedy_request(PROMPTS[i % len(PROMPTS)], MAX_TOKENS, REQUEST_IDS[i])
            request.sampling.ignore_eos = ignore_eos
            ids, _, last = stream_tokens(cluster.stub, request, timeout=60)
            return ids, last.finish_reason

        with ThreadPoolExecutor(len(REQUEST_IDS)) as pool:
            ignoring = list(pool.map(lambda i: one(i, True), range(len(REQUEST_IDS))))
        with ThreadPoolExecutor(len(REQUEST_IDS)) as pool:
            stopping = list(pool.map(lambda i: one(i, False), range(len(REQUEST_IDS))))
        for i, rid in enumerate(REQUEST_IDS):
            want = expected(PROMPTS[i % len(PROMPTS)], rid, eos_ids)
            assert ignoring[i] == (want, "length"), rid
            if rid in early:
                assert stopping[i] == (want[:EOS_STEP], "stop"), rid
            else:
                assert stopping[i] == (want, "length"), rid
                assert not set(want) & set(eos_ids)
        replica = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest(),
                                          timeout=10).replicas[0]
        assert replica.num_steps >= MAX_TOKENS
