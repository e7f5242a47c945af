"""One chat choice's reply text read into what the response carries: `reasoning_content`
(`http_svc.reasoning`), `content` and `tool_calls` (`http_svc.tools`, `http_svc.tool_parsers`),
whether it streams (`feed` each text delta for the delta fields to send now, then `finish`)
or comes whole (`read`). A plain reply (no reasoning parser, no tools read) is its text.
Streamed, an auto call's arguments go out as they come (`http_svc.tool_stream`), and a
named call's too; `required` calls come whole at the end (the array must parse first)."""

from dataclasses import dataclass, field
from typing import Any

from http_svc.reasoning import ReasoningParser, ReasoningStream
from http_svc.tool_parsers import ToolCall, call_id
from http_svc.tool_stream import ToolCallStream
from http_svc.tools import ToolPlan, forced_calls

Delta = dict[str, Any]


@dataclass(slots=True)
class Reply:
    """A whole reply: content is None where it was only calls (as OpenAI answers)."""

    content: str | None
    reasoning: str | None
    calls: list[ToolCall] = field(default_factory=list)

    def message(self, role: str) -> dict[str, Any]:
        body: dict[str, Any] = {"role": role, "content": self.content}
        if self.reasoning is not None:
            body["reasoning_content"] = self.reasoning
        if self.calls:
            body["tool_calls"] = [c.body() for c in self.calls]
        return body


class ReplyReader:
    def __init__(self, plan: ToolPlan | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        self.plan = plan or ToolPlan("none")
        forced = self.plan.structured is not None
        # A forced call is JSON from its first token: no thinking to split off.
        self.reasoning = ReasoningStream(reasoning) if reasoning and not forced else None
        self.tools = ToolCallStream(self.plan.parser) if self.plan.parser else None
        self.calls: list[ToolCall] = []
        self.forced_text = ""
        self.named_id = call_id() if self.plan.mode == "named" else ""
        self.thought = ""
        self.content = ""

    def feed(self, text: str) -> Delta:
        """The delta fields `text` adds now (empty when nothing is ready to send)."""
        if self.plan.structured is not None:
            return self._forced(text)
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if self.tools is None:
            return self._delta(reasoning, content)
        content, calls = self.tools.feed(content)
        return self._delta(reasoning, content, calls)

    def finish(self) -> Delta:
        """What was held back, once the reply has ended: the rest, and the calls."""
        if self.plan.mode == "required":
            calls = forced_calls(self.forced_text)
            if calls is None:     # cut short: the text as it came
                return self._delta("", self.forced_text)
            self.calls = calls
            return {"tool_calls": [c.body(i) for i, c in enumerate(calls)]}
        if self.plan.mode == "named":
            return {}
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if self.tools is None:
            return self._delta(reasoning, content)
        content, calls = self.tools.feed(content)
        rest, more, self.calls = self.tools.finish()
        return self._delta(reasoning, content + rest, calls + more)

    def read(self, text: str) -> Reply:
        """A whole reply."""
        merge(self.feed(text), self.finish())
        thought = self.reasoning is not None and self.reasoning.thought
        content: str | None = self.content
        if self.calls and not (content or "").strip():
            content = None
        return Reply(content, self.thought if thought else None, self.calls)

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def _forced(self, text: str) -> Delta:
        self.forced_text += text
        if self.plan.mode != "named" or not text:
            return {}
        name = self.plan.function or ""
        if self.calls:      # the call was opened: its arguments go on
            self.calls[0] = ToolCall(name, self.forced_text, self.named_id)
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        self.calls = [ToolCall(name, self.forced_text, self.named_id)]
        return {"tool_calls": [self.calls[0].body(0)]}

    def _delta(self, reasoning: str, content: str, calls: list[Delta] | None = None) -> Delta:
        self.thought += reasoning
        self.content += content
        delta: Delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


def merge(first: Delta, second: Delta) -> Delta:
    """Two deltas as one (texts joined, tool calls one after the other)."""
    out = dict(first)
    for key, value in second.items():
        out[key] = out[key] + value if key in out else value
    return out
