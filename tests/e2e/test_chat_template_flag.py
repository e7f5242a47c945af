"""`--chat-template` and the template's tools and documents, end to end: a scheduler started
with a tool-use template (no workers needed: only rendering is checked) renders a chat with
tools, documents and tool messages the same through the HTTP /tokenize, the gRPC Tokenize and
the tokenizer in this process; `splitserve up` forwards the flag to the scheduler."""

import json
import time
from pathlib import Path

import grpc
import pytest

from scheduler_svc.frontend.tokenizer import ChatMessage, load_tokenizer
from services.cli import forward_flags, service_parsers
from services.launcher import ClusterSpec, ServiceProcesses
from services.model_config import default_model_path
from services.rpc.splitserve.v1 import generation_pb2 as pb
from services.rpc.splitserve.v1 import generation_pb2_grpc
from tests.e2e.harness import free_ports
from tests.e2e.test_http_api import post, wait_for_http
from tests.scheduler_svc.frontend.test_chat_template_inputs import CALL, DOCUMENTS, TOOLS

pytestmark = pytest.mark.e2e

TEMPLATE = (Path(__file__).parents[1] / "scheduler_svc" / "frontend" / "chat_templates"
            / "tools_documents.jinja")


def test_tools_and_documents_reach_the_flag_template(tmp_path: Path) -> None:
    port, control, plan, admin, events, store, metrics, http_port = free_ports(8)
    spec = ClusterSpec(port=port, control_port=control, kv_plan_port=plan, kv_admin_port=admin,
                       kv_events_port=events, kv_store_port=store, metrics_port=metrics,
                       http_port=http_port, num_replicas=0,
                       scheduler_args=("--chat-template", str(TEMPLATE)))
    procs = ServiceProcesses(spec, tmp_path)
    procs.start()
    try:
        with grpc.insecure_channel(procs.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            wait_for_http(f"http://127.0.0.1:{http_port}", 503)   # up, no replica
            messages = [{"role": "user", "content": "Weather in Paris?", "name": "ann"},
                        {"role": "assistant", "content": None, "tool_calls": [CALL]},
                        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
            # The front end may have tried the scheduler before it listened: its channel then
            # waits out gRPC's reconnect backoff (a second or so) and answers 503 meanwhile.
            deadline = time.monotonic() + 30
            while True:
                status, http = post(f"http://127.0.0.1:{http_port}/tokenize",
                                    {"messages": messages, "tools": TOOLS,
                                     "documents": DOCUMENTS})
                if status != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert status == 200, http
            stub = generation_pb2_grpc.GenerationStub(channel)
            grpc_ids = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="Weather in Paris?", name="ann"),
                          pb.ChatMessage(role="assistant", tool_calls_json=json.dumps([CALL])),
                          pb.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")],
                tools_json=json.dumps(TOOLS), documents_json=json.dumps(DOCUMENTS))))
            plain = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="Weather in Paris?")])))
    finally:
        procs.stop()
    tokenizer = load_tokenizer(default_model_path(), TEMPLATE.read_text())
    text = tokenizer.render_chat([ChatMessage("user", "Weather in Paris?", "ann"),
                                  ChatMessage("assistant", "", tool_calls=[CALL]),
                                  ChatMessage("tool", "sunny", tool_call_id="call_1")],
                                 True, TOOLS, DOCUMENTS)
    assert "# Tools" in text and "Known for food." in text and "<tool_call>" in text
    assert grpc_ids.prompt == text
    assert http["tokens"] == list(grpc_ids.token_ids) == tokenizer.encode(text)
    assert plain.prompt.startswith("<|im_start|>system\nHelpful.<|im_end|>")  # the flag's


def test_splitserve_up_forwards_the_flag() -> None:
    forwarded = forward_flags(["--chat-template", "t.jinja"], service_parsers())
    assert forwarded["scheduler_svc"] == ["--chat-template", "t.jinja"]
    assert forwarded["http_svc"] == [] and forwarded["worker_svc"] == []
