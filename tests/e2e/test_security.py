"""Who may act on a running cluster: the public port offers the Generation service only; the
control listener refuses calls without the cluster token (and logs them); the metrics port
serves /metrics only. (Frames without the token's tag are refused by every ZMQ receiver:
tests/services/test_codec.py, tests/kvcache_svc/test_server.py.)"""

import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services import cluster_token
from services.rpc.splitserve.v1 import control_pb2, control_pb2_grpc
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import (
    assert_matches_reference,
    greedy_request,
    run_cluster,
    stream_tokens,
)

pytestmark = pytest.mark.e2e


def listed_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    return {s.name for s in response.list_services_response.service}


def test_only_members_may_act_on_the_control_plane(tmp_path: Path, prompts, references  # type: ignore[no-untyped-def]
                                                   ) -> None:
    with run_cluster(tmp_path) as cluster:
        spec = cluster.procs.spec
        # The public port: Generation, health, reflection; no worker registration.
        assert listed_services(cluster.channel) == {
            "splitserve.v1.Generation", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"}
        fake = control_pb2.RegisterRequest(worker_id="intruder", epoch=1, device="cpu",
                                           step_address="tcp://127.0.0.1:1",
                                           model="SmolLM2-135M-Instruct")
        with pytest.raises(grpc.RpcError) as public:
            control_pb2_grpc.WorkerControlStub(cluster.channel).Register(fake, timeout=5)
        assert public.value.code() == grpc.StatusCode.UNIMPLEMENTED

        # The control listener: the token or nothing.
        with grpc.insecure_channel(f"127.0.0.1:{spec.control_port}") as channel:
            control = control_pb2_grpc.WorkerControlStub(channel)
            for metadata in [None, cluster_token.call_metadata("a-guessed-token-12345")]:
                for call, request in [
                        (control.Register, fake),
                        (control.Heartbeat, control_pb2.HeartbeatRequest(worker_id="intruder",
                                                                         epoch=1))]:
                    with pytest.raises(grpc.RpcError) as refused:
                        call(request, timeout=5, metadata=metadata)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        logs = "".join(log.read_text() for log in cluster.log_dir.glob("*.log"))
        # One line for this peer (the other refusals are counted: test_outsider.py).
        assert "refused control-plane calls from 127.0.0.1: /splitserve.v1.WorkerControl/" \
               "Register without a valid cluster token" in logs
        assert "intruder" not in logs                   # never placed, never named

        # Metrics: /metrics and nothing else.
        base = f"http://127.0.0.1:{spec.metrics_port}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            assert b"vllm:num_requests_running" in r.read()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}/", timeout=10)
        assert missing.value.code == 404

        # The members still serve, and match the reference.
        ids, _, _ = stream_tokens(cluster.stub, greedy_request(prompts[0], MAX_TOKENS))
        assert_matches_reference(ids, *references[0], label="after the intruders")
