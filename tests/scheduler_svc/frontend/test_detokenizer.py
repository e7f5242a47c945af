"""Incremental detokenization: same text as a full decode, never broken UTF-8, stop strings
cut (or kept, with include_stop_str_in_output) and held back."""

from scheduler_svc.frontend.detokenizer import IncrementalDetokenizer


def stream(tokenizer, prompt: list[int], outputs: list[int], stop=(),  # type: ignore[no-untyped-def]
           min_tokens: int = 0, keep_stop: bool = False):
    """Feeds `outputs` one token at a time, as the front end does (stop strings checked from
    the `min_tokens`-th output); the deltas handed out, and the stop string that matched."""
    detok = IncrementalDetokenizer(tokenizer.tokenizer, prompt, skip_special_tokens=True,
                                   stop=stop)
    deltas: list[str] = []
    matched = None
    for i, t in enumerate(outputs, start=1):
        matched = detok.update(t, check_stop=i >= min_tokens, keep_stop=keep_stop)
        deltas.append(detok.take_delta(finished=matched is not None))
        if matched is not None:
            break
    if matched is None:
        deltas.append(detok.take_delta(finished=True))
    return deltas, matched


def test_concatenated_deltas_equal_full_decode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("Say something:")
    text = " Voilà — naïve 🎉 emoji and 日本語 text, done."
    outputs = tokenizer.encode(text)
    deltas, _ = stream(tokenizer, prompt, outputs)
    assert "".join(deltas) == tokenizer.decode(outputs)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_across_tokens_waits(tokenizer) -> None:  # type: ignore[no-untyped-def]
    outputs = tokenizer.encode("🎉")
    assert len(outputs) > 1, "the emoji should span several byte-level tokens"
    deltas, _ = stream(tokenizer, [], outputs)
    assert deltas[:-2] == [""] * (len(outputs) - 1) or "".join(deltas) == "🎉"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cut_and_never_emitted(tokenizer) -> None:  # type: ignore[no-untyped-def]
    outputs = tokenizer.encode("The answer is 42. END of story")
    deltas, matched = stream(tokenizer, [], outputs, stop=("END",))
    assert matched == "END"
    assert "".join(deltas) == "The answer is 42. "
    assert not any("E" in d for d in deltas[:-1] if d.endswith("E"))


def test_special_tokens_skipped(tokenizer) -> None:  # type: ignore[no-untyped-def]
    outputs = tokenizer.encode("hi") + [2]
    deltas, _ = stream(tokenizer, [], outputs)
    assert "".join(deltas) == "hi"


def test_unchecked_stop_string_is_kept(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # Before min_tokens the front end does not check: the text is never cut behind its back.
    outputs = tokenizer.encode("The answer is 42. END of story")
    deltas, matched = stream(tokenizer, [], outputs, stop=("END",), min_tokens=len(outputs) + 1)
    assert matched is None
    assert "".join(deltas) == tokenizer.decode(outputs)


def test_check_finds_only_stop_strings_ending_in_new_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    outputs = tokenizer.encode(" x STOP y STOP z")   # " ST" + "OP" are two tokens
    # The first STOP is complete at token 3, unchecked; token 4 is the first check: the
    # longer stop string's hold-back window still covers that STOP, which must not match.
    deltas, matched = stream(tokenizer, [], outputs, stop=("STOP", "a much longer stop"),
                             min_tokens=4)
    assert matched == "STOP"
    assert "".join(deltas) == " x STOP y "
    # A check at the token completing a stop string begun before it: matched and cut.
    deltas, matched = stream(tokenizer, [], outputs, stop=("STOP",), min_tokens=3)
    assert matched == "STOP"
    assert "".join(deltas) == " x "


def test_a_kept_stop_string_ends_the_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # " END" and " of" are separate tokens: the text ends with the stop string, nothing after.
    outputs = tokenizer.encode("The answer is 42. END of story")
    deltas, matched = stream(tokenizer, [], outputs, stop=("END",), keep_stop=True)
    assert matched == "END"
    assert "".join(deltas) == "The answer is 42. END"


def test_a_kept_stop_string_inside_a_token_drops_what_follows_it(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The stop string "S" ends inside the token " ST": the rest of that token ("T") is cut
    # either way; the stop string itself stays only when kept.
    outputs = tokenizer.encode(" x STOP y")
    assert tokenizer.decode(outputs[1:2], True) == " ST"
    deltas, matched = stream(tokenizer, [], outputs, stop=("S",), keep_stop=True)
    assert (matched, "".join(deltas)) == ("S", " x S")
    deltas, matched = stream(tokenizer, [], outputs, stop=("S",))
    assert (matched, "".join(deltas)) == ("S", " x ")
