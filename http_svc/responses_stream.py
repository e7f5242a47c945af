"""A streamed Responses API reply (POST /v1/responses with stream: true), made from the
chat completion stream underneath (http_svc.streaming): its chunks become OpenAI's typed
events, each `event: <type>` with its JSON, numbered by `sequence_number`:

    response.created, response.in_progress
    per output item: response.output_item.added, then
      a message:       response.content_part.added, response.output_text.delta ...,
                       response.output_text.done, response.content_part.done
      a function call: response.function_call_arguments.delta ...,
                       response.function_call_arguments.done
    response.output_item.done; last response.completed (or response.incomplete at the
    length limit) with the whole response, usage included.

The model's reasoning (with a reasoning parser) comes as one `reasoning` item once it is
over. An error after the start is an `error` event, and the stream ends there.
"""

import itertools
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from http_svc.streaming import DONE, EventStream


class _Events:
    """Numbered events and the output items they announce."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self.items: list[dict[str, Any]] = []
        self.text_item: dict[str, Any] | None = None     # the message being written
        self.calls: dict[int, dict[str, Any]] = {}       # tool call index -> its item
        self.reasoning = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(self._numbers), **fields}
        return (f"event: {kind}\ndata: " + json.dumps(payload, ensure_ascii=False)
                + "\n\n").encode()

    def add(self, item: dict[str, Any]) -> bytes:
        self.items.append(item)
        return self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item={**item, "status": "in_progress"})

    def done(self, item: dict[str, Any]) -> bytes:
        item["status"] = "completed"
        return self.event("response.output_item.done", output_index=self.items.index(item),
                          item=item)

    def flush_reasoning(self) -> list[bytes]:
        if not self.reasoning:
            return []
        item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": self.reasoning}]}
        self.reasoning = ""
        return [self.add(item), self.done(item)]

    def text(self, delta: str) -> list[bytes]:
        out = self.flush_reasoning()
        item = self.text_item
        if item is None:
            item = self.text_item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}",
                                     "role": "assistant", "content": []}
            out += [self.add(item), self._part("response.content_part.added", "")]
        item["text"] = item.get("text", "") + delta
        out.append(self.event("response.output_text.delta", item_id=item["id"],
                              output_index=self.items.index(item), content_index=0,
                              delta=delta, logprobs=[]))
        return out

    def close_text(self) -> list[bytes]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        text = item.pop("text")
        item["content"] = [{"type": "output_text", "text": text, "annotations": [],
                            "logprobs": []}]
        index = self.items.index(item)
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                           content_index=0, text=text, logprobs=[]),
                self._part("response.content_part.done", text, item), self.done(item)]

    def _part(self, kind: str, text: str, item: dict[str, Any] | None = None) -> bytes:
        item = item or self.text_item
        assert item is not None
        return self.event(kind, item_id=item["id"], output_index=self.items.index(item),
                          content_index=0, part={"type": "output_text", "text": text,
                                                 "annotations": [], "logprobs": []})

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        out = self.flush_reasoning() + self.close_text()
        item = self.calls.get(delta.get("index", 0))
        function = delta.get("function") or {}
        if item is None:
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": delta.get("id"), "name": function.get("name"), "arguments": ""}
            self.calls[delta.get("index", 0)] = item
            out.append(self.add(item))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=item["id"], output_index=self.items.index(item),
                                  delta=function["arguments"]))
        return out

    def finish(self) -> list[bytes]:
        out = self.flush_reasoning() + self.close_text()
        for item in self.calls.values():
            out += [self.event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=self.items.index(item),
                               arguments=item["arguments"]), self.done(item)]
        self.calls = {}
        return out


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat usage body in the Responses API's names."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]
                                     ["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def response_events(head: dict[str, Any], chat: EventStream) -> EventStream:
    """The Responses events of a chat completion stream of one choice."""

    async def events() -> AsyncIterator[bytes]:
        out = _Events()
        base = {**head, "status": "in_progress", "output": [], "usage": None}
        yield out.event("response.created", response=base)
        yield out.event("response.in_progress", response=base)
        finish, usage = None, None
        async with aclosing(chat.events) as chunks:
            async for raw in chunks:
                if raw == DONE:
                    break
                data = json.loads(raw[len(b"data: "):])
                if "error" in data:
                    error = data["error"]
                    yield out.event("error", code=str(error.get("code")),
                                    message=error.get("message"), param=error.get("param"))
                    return
                usage = data.get("usage") if not data["choices"] else usage
                for choice in data["choices"]:
                    delta = choice["delta"]
                    out.reasoning += delta.get("reasoning_content") or ""
                    for event in out.text(delta["content"]) if delta.get("content") else ():
                        yield event
                    for call in delta.get("tool_calls") or ():
                        for event in out.call(call):
                            yield event
                    finish = choice.get("finish_reason") or finish
        for event in out.finish():
            yield event
        done = finish != "length"
        yield out.event("response.completed" if done else "response.incomplete", response={
            **head, "status": "completed" if done else "incomplete",
            "incomplete_details": None if done else {"reason": "max_output_tokens"},
            "output": out.items, "usage": responses_usage(usage) if usage else None})

    return EventStream(events(), chat.calls)
