"""Tool calls out of a model's reply text, in the formats models are trained to write them
(`--tool-call-parser`, vLLM's names):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as many as it likes,
  after some text or none (Hermes, Qwen 2.5 / 3 and others).
- `llama3_json`: the reply is nothing but the calls, each `{"name": ..., "parameters": {...}}`,
  several separated by `;`, maybe after `<|python_tag|>` (Llama 3.1 / 3.2 / 3.3).
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`, or (tokenizer v11
  on) `[TOOL_CALLS]name[ARGS]{...}` per call.

A parser says where the calls begin (`start`), how much of a text's end could still be the
start of a marker (`hold`, so a stream never sends half a marker as content) and which calls
the text from the start on holds (`calls`; None when it does not parse: then the whole reply
is content, as vLLM answers a malformed call). `ToolCallStream` runs one over a streamed reply.
"""

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str    # JSON text of the arguments object
    id: str

    def body(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry; with `index`, a streamed delta's."""
        body: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates take 9 letters and digits, and refuse other ids."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def arguments_text(value: Any) -> str | None:
    """A call's arguments as JSON text (an object given as text is kept as written)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(parsed, dict) else None
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


def call_from_json(value: Any, make_id: Any = call_id) -> ToolCall | None:
    """`{"name": ..., "arguments"|"parameters": {...}}` as a call; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    raw = value.get("arguments", value.get("parameters", {}))
    arguments = arguments_text(raw)
    return None if arguments is None else ToolCall(value["name"], arguments, make_id())


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values written one after another in `text` (whitespace and `separators`
    between them); None if anything else is there."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


class ToolParser:
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    anywhere: ClassVar[bool] = True     # False: calls only where the reply starts
    # The markers are special tokens, which outputs leave out unless asked; then the reply
    # also ends in its end-of-turn token's text (a trailer), which is not content.
    keep_special_tokens: ClassVar[bool] = False
    trailers: ClassVar[tuple[str, ...]] = ()

    def start(self, text: str) -> int | None:
        """Where the first call begins in `text`, or None."""
        if not self.anywhere:
            at = len(text) - len(text.lstrip())
            return at if text[at:].startswith(self.markers) else None
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    def hold(self, text: str) -> int:
        """How many characters at the end of `text` may still begin a call or a trailer."""
        held = max((k for m in self.markers + self.trailers for k in range(1, len(m) + 1)
                    if text.endswith(m[:k])), default=0)
        if not self.anywhere:
            rest = text.lstrip()
            if any(m.startswith(rest) for m in self.markers):
                return len(text)
        return held

    def calls(self, text: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content before the calls, and the calls (none: all of it is content)."""
        at = self.start(text)
        calls = None if at is None else self.calls(self._trim(text[at:]))
        if not calls or at is None:
            return self.untrailed(text), []
        return text[:at], calls

    def untrailed(self, text: str) -> str:
        """Content without the end-of-turn text it may end with."""
        for trailer in self.trailers:
            if text.endswith(trailer):
                return text[:-len(trailer)]
        return text

    def _trim(self, text: str) -> str:
        text = text.rstrip()
        for trailer in self.trailers:
            text = text.removesuffix(trailer).rstrip()
        return text


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def calls(self, text: str) -> list[ToolCall] | None:
        """Text between or after the calls is dropped, as vLLM drops it; the last call may
        lack its `</tool_call>` (the model ended its turn there)."""
        calls = []
        for part in text.split("<tool_call>")[1:]:
            values = json_values(part.partition("</tool_call>")[0])
            call = call_from_json(values[0]) if values and len(values) == 1 else None
            if call is None:
                return None
            calls.append(call)
        return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    anywhere = False
    keep_special_tokens = True
    trailers = ("<|eot_id|>", "<|eom_id|>")

    def calls(self, text: str) -> list[ToolCall] | None:
        values = json_values(text.removeprefix("<|python_tag|>"), ";")
        calls = [call_from_json(v) for v in values or ()]
        return [c for c in calls if c is not None] if values and None not in calls else None


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    keep_special_tokens = True
    trailers = ("</s>",)

    def calls(self, text: str) -> list[ToolCall] | None:
        calls: list[ToolCall | None] = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if part.startswith(("[", "{")):
                values = json_values(part)
                if values is None or len(values) != 1:
                    return None
                items = values[0] if isinstance(values[0], list) else values
                calls += [call_from_json(v, mistral_call_id) for v in items]
            else:
                name, found, arguments = part.partition("[ARGS]")
                values = json_values(arguments) if found else None
                if not name.strip() or not values or len(values) != 1:
                    return None
                calls.append(call_from_json({"name": name.strip(), "arguments": values[0]},
                                            mistral_call_id))
        if not calls or None in calls:
            return None
        return [c for c in calls if c is not None]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


class ToolCallStream:
    """A streamed reply through a parser: `feed` each text delta for the content that can be
    sent now; `finish` at the end for the rest of the content and the calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0                  # characters of `text` sent as content
        self.at: int | None = None     # where the calls begin, once seen

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.at is not None:
            return ""
        self.at = self.parser.start(self.text)
        end = self.at if self.at is not None else len(self.text) - self.parser.hold(self.text)
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        calls = None
        if self.at is not None:
            calls = self.parser.calls(self.parser._trim(self.text[self.at:]))
        if not calls:
            out = self.parser.untrailed(self.text)[self.sent:]
            self.sent = len(self.text)
            return out, []
        return "", calls
