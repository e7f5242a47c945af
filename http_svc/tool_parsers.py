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
is content, as vLLM answers a malformed call), and where each call's head ends (`head`: its
name and where its arguments object opens, so a stream can send the arguments as they come;
`http_svc.tool_stream`).
"""

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
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


# A call's head as JSON: `{"name": "...", "arguments"|"parameters": ` up to its arguments
# object's `{` (a head written in another key order, or arguments given as text, is not
# streamed: that call comes whole at the end).
JSON_HEAD = (r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,'
             r'\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')

# Mistral's tokenizer v11 form: `[TOOL_CALLS]name[ARGS]{...}`.
ARGS_HEAD = r"\[TOOL_CALLS\](?P<raw>[^\[\]{}]+)\[ARGS\](?=\{)"


class ToolParser:
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    anywhere: ClassVar[bool] = True     # False: calls only where the reply starts
    # The markers are special tokens, which outputs leave out unless asked; then the reply
    # also ends in its end-of-turn token's text (a trailer), which is not content.
    keep_special_tokens: ClassVar[bool] = False
    trailers: ClassVar[tuple[str, ...]] = ()
    # Where a call's head may be matched: the first from where the calls begin, the next
    # from the end of the previous call's arguments object.
    first_heads: ClassVar[tuple[re.Pattern[str], ...]] = ()
    next_heads: ClassVar[tuple[re.Pattern[str], ...]] = ()
    new_id: ClassVar[Callable[[], str]] = staticmethod(call_id)

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

    def head(self, text: str, at: int, first: bool) -> tuple[str, int] | None:
        """The name of the call whose head `text` holds from `at`, and where its arguments
        object opens; None while (or if) there is no such head there."""
        for pattern in self.first_heads if first else self.next_heads:
            found = pattern.match(text, at)
            if found is None:
                continue
            try:
                name = (json.loads(found["name"]) if "name" in pattern.groupindex
                        else found["raw"].strip())
            except ValueError:
                return None
            return (name, found.end()) if isinstance(name, str) and name else None
        return None

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
    # The next `<tool_call>` (not a later one: a call that cannot stream stops the streaming).
    first_heads = (re.compile(r"(?s)(?:(?!<tool_call>).)*<tool_call>" + JSON_HEAD),)
    next_heads = first_heads

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
    first_heads = (re.compile(r"(?:<\|python_tag\|>)?" + JSON_HEAD),)
    next_heads = (re.compile(r"\s*\}\s*;" + JSON_HEAD),)

    def calls(self, text: str) -> list[ToolCall] | None:
        values = json_values(text.removeprefix("<|python_tag|>"), ";")
        calls = [call_from_json(v) for v in values or ()]
        return [c for c in calls if c is not None] if values and None not in calls else None


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    keep_special_tokens = True
    trailers = ("</s>",)
    new_id = staticmethod(mistral_call_id)
    # In an array (the next after `, `), a new `[TOOL_CALLS]` array, or `name[ARGS]`.
    first_heads = (re.compile(r"\[TOOL_CALLS\]\s*\[?" + JSON_HEAD), re.compile(ARGS_HEAD))
    next_heads = (re.compile(r"\s*\}\s*," + JSON_HEAD),
                  re.compile(r"\s*\}\s*\]\s*\[TOOL_CALLS\]\s*\[?" + JSON_HEAD),
                  re.compile(r"\s*" + ARGS_HEAD))

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
