"""`--tokenizer` and `--generation-config`, end to end on the default model: the scheduler
tokenizes with the given HF tokenizer directory (its post-processor's BOS on a completion's
prompt, its chat templates given as a list, "tool_use" for a chat with tools), and requests
that leave sampling fields unset take the given generation_config.json's (greedy, 5 new
tokens), through the gRPC API and the HTTP front end alike."""

import json
import urllib.request
from pathlib import Path

import pytest

from scripts.random_model import export_tokenizer
from services.rpc.splitserve.v1 import generation_pb2 as pb
from tests.e2e.harness import run_cluster, stream_tokens

pytestmark = pytest.mark.e2e

BOS_ID = 0                      # SmolLM2's <|endoftext|>, made BOS in the directory's tokenizer
PROMPT = "Once upon a time"


def tokenizer_dir(tmp_path: Path) -> Path:
    """SmolLM2's tokenizer as an HF directory whose post-processor adds BOS and whose
    tokenizer_config names two chat templates."""
    path = export_tokenizer(tmp_path / "tokenizer")
    tok = json.loads((path / "tokenizer.json").read_text())
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS_ID],
                                             "tokens": ["<|endoftext|>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": cfg["chat_template"]},
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}{% for m in messages %}"
                                         "<|im_start|>{{ m.content }}{% endfor %}"}]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_tokenizer_and_generation_config_flags(tmp_path: Path) -> None:
    defaults = tmp_path / "generation"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 5, "top_k": 50}))
    args = ("--tokenizer", str(tokenizer_dir(tmp_path)), "--generation-config", str(defaults))
    with run_cluster(tmp_path / "logs", scheduler_args=args, http=True) as cluster:
        text = cluster.stub.Tokenize(pb.TokenizeRequest(text=PROMPT))
        assert text.token_ids[0] == BOS_ID and BOS_ID not in text.token_ids[1:]
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
        plain = cluster.stub.Tokenize(pb.TokenizeRequest(chat=chat))
        assert plain.prompt.startswith("<|im_start|>") and BOS_ID not in plain.token_ids
        chat.tools_json = json.dumps([{"type": "function", "function": {"name": "f"}}])
        tools = cluster.stub.Tokenize(pb.TokenizeRequest(chat=chat))
        assert tools.prompt == "TOOLS 1<|im_start|>Hi"

        unset = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(ignore_eos=True))
        ids, _, last = stream_tokens(cluster.stub, unset)
        assert (len(ids), last.finish_reason) == (5, "length")
        assert last.usage.prompt_tokens == len(text.token_ids)
        greedy = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True))
        assert stream_tokens(cluster.stub, greedy)[0] == ids
        # A request's own max_tokens is capped by max_new_tokens, as in vLLM.
        more = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=9, ignore_eos=True))
        assert stream_tokens(cluster.stub, more)[0] == ids
        # HTTP: a completion that sends no sampling knob gets the same defaults (http_svc
        # leaves them unset on the way to the scheduler).
        _, text_out, _ = stream_tokens(cluster.stub, unset)
        body = json.dumps({"prompt": PROMPT, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://{cluster.procs.http_address}/v1/completions",
                                     data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            reply = json.load(resp)
        assert reply["usage"]["completion_tokens"] == 5
        assert reply["choices"][0]["text"] == text_out
