"""Tool calling, reasoning and the fields vLLM's clients send, through the real services
(issue 38, points 1 and 2), with the official `openai` client where it can be. The model is
the default one, which cannot be relied on to call a tool by itself, so the calls are forced
(tool_choice "required" or a named function: the scheduler's grammar) and the parsers' text
formats are unit-tested (tests/http_svc/test_tool_parsers.py); here: a forced call parses,
finishes with "tool_calls" and streams as deltas, a multi-turn round trip reaches the chat
template, the Responses API answers text and calls (plain and streamed), a `<think>` reply
(forced by a regex) splits into reasoning_content, chat_template_kwargs reach the template
(a test template that reads enable_thinking), and guidellm's / lm-eval's requests pass:
continuous usage stats, add_special_tokens, developer messages, unknown fields, /ping,
/tokenizer_info, X-Request-Id."""

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.harness import RunningCluster, run_cluster
from tests.e2e.test_http_api import get, post, wait_for_http

pytestmark = pytest.mark.e2e

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string",
                                                        "enum": ["Paris", "Rome", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "description": "The weather in a city",
                                            "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# ChatML (the default model's tokens), with tools and tool calls, and Qwen3's enable_thinking.
TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif -%}
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.tool_calls is defined %}{% for c in m.tool_calls -%}
<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif -%}
<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    logs = tmp_path_factory.mktemp("http_tools")
    template = Path(logs, "template.jinja")
    template.write_text(TEMPLATE)
    env = {"SPLITSERVE_HTTP_TOOL_CALL_PARSER": "hermes",
           "SPLITSERVE_HTTP_ENABLE_AUTO_TOOL_CHOICE": "true",
           "SPLITSERVE_HTTP_REASONING_PARSER": "qwen3"}
    with run_cluster(logs, http=True, env=env,
                     scheduler_args=["--chat-template", str(template)]) as running:
        wait_for_http(f"http://{running.procs.http_address}", 200)
        yield running


@pytest.fixture(scope="module")
def base(cluster: RunningCluster) -> str:
    return f"http://{cluster.procs.http_address}"


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_what_vllm_clients_send(base: str, cluster: RunningCluster) -> None:
    # guidellm: continuous usage stats on every streamed chunk.
    body = {"messages": [{"role": "developer", "content": "Be brief."}, *QUESTION],
            "max_tokens": 4, "stream": True, "reasoning_effort": "low", "metadata": {"a": "b"},
            "store": False, "some_new_field": 1,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json",
                                      "x-request-id": "guidellm-7"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.headers["x-request-id"] == "guidellm-7"
        events = [json.loads(line[6:]) for line in r.read().decode().split("\n\n")
                  if line.startswith("data: {")]
    assert all("usage" in e for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == events[-1]["usage"]["completion_tokens"]
    # lm-eval's remote tokenizer.
    status, tokens = post(f"{base}/tokenize", {"prompt": "Hello world",
                                               "add_special_tokens": False})
    assert status == 200 and tokens["count"] > 0
    status, info = get(f"{base}/tokenizer_info")
    info = json.loads(info)
    assert status == 200 and info["model_max_length"] == tokens["max_model_len"]
    assert info["eos_token"] and info["eos_token_id"] in info["eos_token_ids"]
    assert get(f"{base}/ping")[0] == 200
    assert "ignored unknown field some_new_field" in cluster.logs()


def test_a_required_tool_call_is_forced_and_parsed(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=64)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]
    jsonschema.validate(json.loads(call.function.arguments), schema["parameters"])  # type: ignore[index]


def test_a_named_tool_call_streams_as_deltas(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[WEATHER, TIME], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    names, arguments, finish, num_deltas = [], "", None, 0
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                num_deltas += 1
                assert delta.index == 0
                names += [delta.function.name] if delta.function and delta.function.name else []
                arguments += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert num_deltas > 1                      # the arguments came as they were generated
    jsonschema.validate(json.loads(arguments), PARAMETERS)


def test_a_multi_turn_tool_round_trip(client: openai.OpenAI, model: str, base: str) -> None:
    first = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=64)
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    messages: list[Any] = [*QUESTION, message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id,
                            "content": "Sunny and 24 degrees."}]
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                            temperature=0, max_tokens=12)
    (choice,) = second.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # The conversation reached the template: the call and its result are in the prompt.
    status, tokens = post(f"{base}/tokenize", {"messages": messages, "tools": [WEATHER]})
    assert status == 200
    _, text = post(f"{base}/detokenize", {"tokens": tokens["tokens"]})
    assert "Sunny and 24 degrees." in text["prompt"]
    assert '"name": "get_weather"' in text["prompt"] and "# Tools" in text["prompt"]
    assert second.usage is not None and second.usage.prompt_tokens == tokens["count"]


def test_the_responses_api(client: openai.OpenAI, model: str) -> None:
    text = client.responses.create(model=model, input="Say hello.", max_output_tokens=8,
                                   temperature=0)
    assert text.status in ("completed", "incomplete") and text.output_text
    assert text.usage is not None and text.usage.output_tokens >= 1
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    called = client.responses.create(model=model, input="Weather in Rome?", tools=tools,
                                     tool_choice="required", temperature=0,
                                     max_output_tokens=64)
    (item,) = [i for i in called.output if i.type == "function_call"]
    jsonschema.validate(json.loads(item.arguments), PARAMETERS)
    follow = client.responses.create(
        model=model, temperature=0, max_output_tokens=8, tools=tools,
        input=[{"role": "user", "content": "Weather in Rome?"},
               {"type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments},
               {"type": "function_call_output", "call_id": item.call_id, "output": "Rainy."}])
    assert follow.output_text or any(i.type == "function_call" for i in follow.output)
    events = list(client.responses.create(model=model, input="Say hello.", temperature=0,
                                          max_output_tokens=8, stream=True))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and events[-1].response.output_text == deltas


def test_thinking_is_reasoning_content(client: openai.OpenAI, model: str) -> None:
    """A reply forced (by a regex) to think first is split by the qwen3 reasoning parser."""
    regex = r"<think>[a-z ]{1,12}</think>[A-Za-z ]{1,12}\."
    response = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40,
        extra_body={"structured_outputs": {"regex": regex}})
    message = response.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert response.choices[0].finish_reason == "stop"
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and message.content.endswith(".") and "think>" not in message.content
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40, stream=True,
        extra_body={"structured_outputs": {"regex": regex}})
    parts = [(getattr(c.choices[0].delta, "reasoning_content", None) or "",
              c.choices[0].delta.content or "") for c in stream if c.choices]
    assert "".join(r for r, _ in parts) == reasoning
    assert "".join(c for _, c in parts) == message.content


def test_chat_template_kwargs_reach_the_template(base: str) -> None:
    plain = post(f"{base}/tokenize", {"messages": QUESTION})[1]
    off = post(f"{base}/tokenize", {"messages": QUESTION,
                                    "chat_template_kwargs": {"enable_thinking": False}})[1]
    text = post(f"{base}/detokenize", {"tokens": off["tokens"]})[1]["prompt"]
    assert off["tokens"][:plain["count"]] == plain["tokens"] and off["count"] > plain["count"]
    assert text.endswith("<think>\n\n</think>\n\n")
    status, reply = post(f"{base}/v1/chat/completions", {
        "messages": QUESTION, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and reply["usage"]["prompt_tokens"] == off["count"]
