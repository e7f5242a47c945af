"""Reasoning split from content (http_svc.reasoning): each parser's rule for where thinking
starts and ends, and a streamed reply split as the whole one is, never sending half a tag."""

import pytest

from http_svc.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream, split

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("parser, text, expected", [
    (R1, "<think>\nweigh it</think>\n\nParis.", ("\nweigh it", "\n\nParis.")),
    (R1, "weigh it</think>Paris.", ("weigh it", "Paris.")),     # <think> was in the prompt
    (R1, "still thinking when cut", ("still thinking when cut", "")),
    (QWEN3, "<think>\nweigh it</think>\n\nParis.", ("\nweigh it", "\n\nParis.")),
    (QWEN3, "Paris.", (None, "Paris.")),                          # enable_thinking false
    (QWEN3, "<think>cut", ("cut", "")),
    (QWEN3, "", (None, "")),
])
def test_split(parser: ReasoningParser, text: str, expected: tuple[str | None, str]) -> None:
    assert split(parser, text) == expected


@pytest.mark.parametrize("parser", [R1, QWEN3])
@pytest.mark.parametrize("text", ["<think>a < b</think>\n\nyes </thin", "  <thi", "x</think>",
                                  "<think></think>answer"])
@pytest.mark.parametrize("step", [1, 2, 100])
def test_a_stream_splits_as_the_whole_reply(parser: ReasoningParser, text: str,
                                            step: int) -> None:
    stream = ReasoningStream(parser)
    parts = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
    parts.append(stream.finish())
    reasoning, content = split(parser, text)
    assert "".join(r for r, _ in parts) == (reasoning or "")
    assert "".join(c for _, c in parts) == content
    assert all("</think>" not in r and "<think>" not in r for r, _ in parts)


def test_a_stream_holds_a_partial_end_tag() -> None:
    stream = ReasoningStream(R1)
    assert stream.feed("hmm </th") == ("hmm ", "")
    assert stream.feed("ink>Paris") == ("", "Paris")
