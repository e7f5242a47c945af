"""A streamed reply read for tool calls (`tool_choice: "auto"`) as vLLM streams them: the text
before the calls goes on as content (less what may begin a marker, held until it is clear);
each call opens with a `tool_calls` delta carrying its `index`, `id`, `type` and
`function.name` (arguments ""), once its head is whole, then its arguments object's text
as it is generated (raw: the deltas add up to exactly the object's JSON text, never the
braces or markers that close the call). Parallel calls get increasing indices.

At the end the whole text is parsed as a reply that came whole is (`ToolParser.calls`), and
that parse decides: its calls are the reply's (a call whose head could not stream, such as
arguments given as a JSON string, is sent whole then). If it does not parse (a malformed or
cut-off call), the reply is content, as a whole reply is: the text from where the calls began
is sent as content and the finish reason stays the model's, so a client then holds the
content of the whole reply, plus the deltas of any call that had already opened (a name and
some arguments), which the finish reason (not "tool_calls") says to disregard.
"""

from dataclasses import dataclass
from typing import Any

from http_svc.tool_parsers import ToolCall, ToolParser

Delta = dict[str, Any]


@dataclass(slots=True)
class OpenCall:
    """A call whose head was sent; its arguments object is scanned as it grows, so the
    stream knows where the object closes (strings and nesting tracked, not parsed)."""

    index: int
    id: str
    name: str
    scanned: int           # how far the text was scanned (and sent): from the object's `{`
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    closed: bool = False

    def advance(self, text: str) -> str:
        """The arguments text added since the last call, up to where the object closes."""
        at = self.scanned
        while at < len(text) and not self.closed:
            char = text[at]
            at += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
        out, self.scanned = text[self.scanned:at], at
        return out


class ToolCallStream:
    """A streamed reply through a parser: `feed` each text delta for the content and the
    `tool_calls` deltas to send now; `finish` at the end for the rest and the reply's calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0                  # characters of `text` sent as content
        self.at: int | None = None     # where the calls begin, once seen
        self.cursor = 0                # where the next call's head is looked for
        self.opened: list[OpenCall] = []

    def feed(self, delta: str) -> tuple[str, list[Delta]]:
        self.text += delta
        if self.at is not None:
            return "", self._calls()
        self.at = self.parser.start(self.text)
        end = self.at if self.at is not None else len(self.text) - self.parser.hold(self.text)
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        if self.at is None:
            return out, []
        self.cursor = self.at
        return out, self._calls()

    def _calls(self) -> list[Delta]:
        """The deltas of the calls' text seen so far: heads once whole, then arguments."""
        deltas: list[Delta] = []
        while True:
            if self.opened and not self.opened[-1].closed:
                call = self.opened[-1]
                arguments = call.advance(self.text)
                if arguments:
                    deltas.append({"index": call.index, "function": {"arguments": arguments}})
                if not call.closed:
                    return deltas
                self.cursor = call.scanned
            head = self.parser.head(self.text, self.cursor, not self.opened)
            if head is None:
                return deltas
            name, start = head
            call = OpenCall(len(self.opened), self.parser.new_id(), name, start)
            self.opened.append(call)
            deltas.append(ToolCall(name, "", call.id).body(call.index))

    def finish(self) -> tuple[str, list[Delta], list[ToolCall]]:
        """The content still to send, the calls' deltas still to send, and the calls (none:
        the reply did not parse as calls, and the text from the calls' start is content)."""
        calls = None
        if self.at is not None:
            calls = self.parser.calls(self.parser._trim(self.text[self.at:]))
        if not calls:
            out = self.parser.untrailed(self.text)[self.sent:]
            self.sent = len(self.text)
            return out, [], []
        deltas, final = [], []
        for i, call in enumerate(calls):
            if i < len(self.opened):
                # Sent already, as the scan read it: the parse's own arguments are the same
                # JSON (a head with a duplicated key, read otherwise by the parse, keeps
                # what was sent; the calls returned are the parse's, as a whole reply's).
                final.append(ToolCall(call.name, call.arguments, self.opened[i].id))
            else:
                deltas.append(call.body(i))
                final.append(call)
        return "", deltas, final
