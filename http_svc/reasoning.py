"""A reasoning model's thinking split from its answer (`--reasoning-parser`, vLLM's names):
the text between `<think>` and `</think>` becomes the reply's `reasoning_content`, the rest
its `content`.

- `deepseek_r1`: the reply starts inside the thinking (the chat template opened `<think>`
  in the prompt; a `<think>` the model writes anyway is dropped) and leaves it at `</think>`;
  a reply without `</think>` is all reasoning.
- `qwen3`: thinking only where the reply starts with `<think>` (Qwen3 with `enable_thinking`
  false, in `chat_template_kwargs`, writes none, and its reply is all content).

`ReasoningStream` splits a reply as it streams (never sending half a tag), and `split`, the
same over a whole reply.
"""

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    starts_inside: bool      # the reply is reasoning until </think>, <think> or not


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True),
                                          ReasoningParser("qwen3", False))}


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` begin `tag`."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ReasoningStream:
    """`feed` each text delta, then `finish`; each returns (reasoning, content) to send."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = "start"      # "start" (before the first word), "inside", "after"
        self.pending = ""         # text held back: it may begin a tag
        self.thought = False      # whether the reply had a thinking part

    def feed(self, delta: str) -> tuple[str, str]:
        text, self.pending = self.pending + delta, ""
        reasoning = ""
        if self.state == "start":
            rest = text.lstrip()
            if START.startswith(rest):       # nothing yet, or part of <think>
                self.pending = text
                return "", ""
            if rest.startswith(START):
                self.state, text = "inside", rest[len(START):]
            else:
                self.state = "inside" if self.parser.starts_inside else "after"
            self.thought = self.state == "inside"
        if self.state == "inside":
            before, found, after = text.partition(END)
            if not found:
                keep = _partial_suffix(text, END)
                self.pending = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self.state = before, after, "after"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning inside the thinking, else content."""
        text, self.pending = self.pending, ""
        if self.state == "start" and text.strip():     # a reply that is a bit of "<think>"
            self.thought = self.parser.starts_inside
            return (text, "") if self.thought else ("", text)
        return (text, "") if self.state == "inside" else ("", text)


def split(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """A whole reply's (reasoning, content); reasoning None where there was no thinking."""
    stream = ReasoningStream(parser)
    parts = [stream.feed(text), stream.finish()]
    return ("".join(r for r, _ in parts) if stream.thought else None,
            "".join(c for _, c in parts))
