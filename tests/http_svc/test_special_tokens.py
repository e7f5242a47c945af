"""`add_special_tokens` (http_svc.special_tokens) against a scheduler whose tokenizer puts a
BOS (id 0) in front of every text, as a Llama's does: completions and /tokenize keep it by
default and leave it out when asked; chats get it only when asked."""

import asyncio
from typing import Any

from http_svc.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from http_svc.scheduler_client import Prompt
from http_svc.serving import OpenAIServing
from http_svc.special_tokens import without
from tests.http_svc.test_serving import FakeClient, Ready

BOS = 0


class BosClient(FakeClient):
    async def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True,
                       ) -> tuple[list[int], str]:
        ids, text = await super().tokenize(prompt, add_generation_prompt)
        return ([BOS, *ids] if prompt.chat is None else ids), text


def serve(method: str, body: Any) -> tuple[Any, BosClient]:
    client = BosClient()
    serving = OpenAIServing(client, Ready())  # type: ignore[arg-type]
    return asyncio.run(getattr(serving, method)(body)), client


def test_completions() -> None:
    _, client = serve("completions", CompletionRequest(prompt="hey", max_tokens=2))
    assert client.specs[0].prompt.text == "hey"       # the scheduler adds the BOS
    _, client = serve("completions", CompletionRequest(prompt="hey", max_tokens=2,
                                                       add_special_tokens=False))
    assert client.specs[0].prompt.token_ids == (1, 1, 1)


def test_chat() -> None:
    messages = [{"role": "user", "content": "hey"}]
    _, client = serve("chat", ChatCompletionRequest.model_validate(
        {"messages": messages, "max_tokens": 2}))
    assert client.specs[0].prompt.chat == (("user", "hey"),)
    _, client = serve("chat", ChatCompletionRequest.model_validate(
        {"messages": messages, "max_tokens": 2, "add_special_tokens": True}))
    assert client.specs[0].prompt.token_ids == (BOS, 1, 1, 1, 1, 1)


def test_tokenize() -> None:
    assert serve("tokenize", TokenizeCompletionRequest(prompt="ab"))[0]["tokens"] == [BOS, 1, 1]
    assert serve("tokenize", TokenizeCompletionRequest(
        prompt="ab", add_special_tokens=False))[0]["tokens"] == [1, 1]
    chat = {"messages": [{"role": "user", "content": "ab"}], "add_generation_prompt": False}
    assert serve("tokenize", TokenizeChatRequest.model_validate(chat))[0]["tokens"] == [1, 1]
    assert serve("tokenize", TokenizeChatRequest.model_validate(
        {**chat, "add_special_tokens": True}))[0]["tokens"] == [BOS, 1, 1]


def test_without() -> None:
    assert without([5, 1, 2], [5]) == [1, 2] and without([1, 2, 9], [9]) == [1, 2]
    assert without([1, 2], [5]) == [1, 2] and without([1, 2], []) == [1, 2]
