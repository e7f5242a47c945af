"""A GGUF file's tokenizer metadata -> a `tokenizers.Tokenizer`, built as transformers 5 builds
it from the same file (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), which is what
vLLM serves a GGUF model with. tests/services/test_gguf_tokenizer.py holds the two side by
side on files of each kind: token ids, special tokens, BOS / EOS and decoded text.

Two vocabulary kinds (`tokenizer.ggml.model`):

- "gpt2", byte-level BPE (Llama 3, Qwen2/3, SmolLM): the merges are learned on one regex split
  of the text, named by `tokenizer.ggml.pre` (llama.cpp's names). A name not listed here is
  refused: another split gives other token ids without any error. A token that is not written
  in the GPT-2 byte alphabet is respelled into it, as transformers does.
- "llama", SentencePiece BPE with byte fallback (Llama 2, Mistral): "▁" for spaces, one
  prepended to the text's start, bytes as `<0xNN>` pieces; the merges come from the file or,
  where it has none (the usual case), from the pieces' scores.

Control tokens (token type 3) and the tokens the file names as BOS / EOS / unknown / padding
become special tokens; user-defined ones (type 4, e.g. `<think>`) are matched whole but are
not special. BOS is added to an encoding with special tokens where `tokenizer.ggml.add_bos_token`
says so (SentencePiece files without the key: yes, as llama.cpp and transformers have it), EOS
where `add_eos_token` does.

Not copied from transformers: its byte-level builder also adds GPT-2's `<|endoftext|>` as a
new id past the file's vocabulary (an id no logit exists for); that token is left out here.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6   # llama.cpp's types

# The splits of `tokenizer.ggml.pre`, written out from llama.cpp's definitions.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_SPLITS: dict[str, str] = {
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "qwen35": _QWEN35, "tekken": _TEKKEN, "gpt-4o": _GPT4O,
}
# GPT-2's own split, with every digit split off first where llama.cpp's pre-tokenizer does so.
DIGIT_SPLITS = {"gpt-2": False, "smollm": True, "starcoder": True, "refact": True}
SUPPORTED_PRE = tuple(sorted({*REGEX_SPLITS, *DIGIT_SPLITS}))
# Architectures whose SentencePiece vocabulary transformers builds another way (Gemma's merges
# follow file order, Phi-3 prepends its spaces by a normalizer).
SENTENCEPIECE_ELSEWHERE = frozenset({"gemma", "gemma2", "gemma3", "phi3"})


@dataclass(frozen=True, slots=True)
class TokenizerParts:
    """A built tokenizer and what its chat templates and special-token handling need."""

    tokenizer: Tokenizer            # post-processor set: BOS / EOS as the file asks
    bos_token: str | None
    eos_token: str | None
    other_special_tokens: dict[str, str] = field(default_factory=dict)   # unk / pad, by name
    chat_templates: dict[str, str] = field(default_factory=dict)  # name -> template;
                                                                    # "default" = the plain one


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes stand for themselves, the others for
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update((b, chr(0x100 + i)) for i, b in enumerate(extra))
    return table


def bos_eos_processor(tokenizer: Tokenizer, bos: str | None, eos: str | None, add_bos: bool,
                      add_eos: bool) -> processors.TemplateProcessing:
    """The post-processor that puts BOS before (`add_bos`) and EOS after (`add_eos`) a
    sequence encoded with special tokens; a token that is not in the vocabulary adds nothing."""
    bos_id = None if bos is None or not add_bos else tokenizer.token_to_id(bos)
    eos_id = None if eos is None or not add_eos else tokenizer.token_to_id(eos)
    single = [f"{bos}:0"] * (bos_id is not None) + ["$A:0"] + [f"{eos}:0"] * (eos_id is not None)
    specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if i is not None]
    return processors.TemplateProcessing(single=" ".join(single),
                                         special_tokens=specials)  # type: ignore[arg-type]


def tokenizer_from_gguf(path: Path, fields: Mapping[str, object]) -> TokenizerParts:
    """Raises ValueError naming the field for a vocabulary this does not build."""
    def value(name: str) -> object | None:
        found = fields.get(name)
        return found.tolist() if isinstance(found, np.ndarray) else found

    kind = value("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (gpt2: "
                         "byte-level BPE; llama: SentencePiece BPE)")
    tokens = value("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    types: list[int] = value("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)  # type: ignore
    merges: list[str] | None = value("tokenizer.ggml.merges")  # type: ignore[assignment]
    if len(types) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    if kind == "gpt2":
        tokenizer, spelled = _byte_level(path, tokens, merges, value("tokenizer.ggml.pre"))
        add_bos_default = False
    else:
        arch = value("general.architecture")
        if arch in SENTENCEPIECE_ELSEWHERE:
            raise ValueError(f"{path}: a SentencePiece vocabulary of architecture {arch!r} is "
                             "built differently (its spaces, or its merges' order); not "
                             "supported")
        scores = value("tokenizer.ggml.scores")
        if merges is None and (not isinstance(scores, list) or len(scores) != len(tokens)):
            raise ValueError(f"{path}: tokenizer.ggml.scores must give one score per token "
                             "when the file has no tokenizer.ggml.merges")
        tokenizer, spelled = _sentencepiece(tokens, merges, scores), tokens  # type: ignore
        add_bos_default = True
    named = _named_tokens(path, value, tokens, spelled)
    _add_special_tokens(tokenizer, tokens, spelled, types, set(named.values()))
    add_bos = value("tokenizer.ggml.add_bos_token")
    add_eos = value("tokenizer.ggml.add_eos_token")
    tokenizer.post_processor = bos_eos_processor(
        tokenizer, named.get("bos_token"), named.get("eos_token"),
        add_bos_default if add_bos is None else bool(add_bos), bool(add_eos))
    return TokenizerParts(tokenizer, named.pop("bos_token", None), named.pop("eos_token", None),
                          named, _chat_templates(path, fields))


def _named_tokens(path: Path, value: Callable[[str], object | None], tokens: list[str],
                  spelled: list[str]) -> dict[str, str]:
    """bos_token, eos_token, unk_token and pad_token by the ids the file gives, as the file
    spells them (a respelled one is left out: its text is not what the vocabulary matches)."""
    named = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = value(f"tokenizer.ggml.{key}_token_id")
        if token_id is None:
            continue
        index = int(token_id)  # type: ignore[call-overload]
        if not 0 <= index < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{key}_token_id {index} is outside the "
                             f"vocabulary of {len(tokens)}")
        if spelled[index] == tokens[index]:
            named[name] = tokens[index]
    return named


def _byte_level(path: Path, tokens: list[str], merges: list[str] | None,
                pre: object) -> tuple[Tokenizer, list[str]]:
    if pre is None:
        raise ValueError(f"{path}: tokenizer.ggml.pre is missing, so the text split its merges "
                         f"expect is unknown (supported: {', '.join(SUPPORTED_PRE)})")
    if pre not in REGEX_SPLITS and pre not in DIGIT_SPLITS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_PRE)}); another split would give wrong token "
                         "ids")
    table = byte_alphabet()
    alphabet = set(table.values())
    spelled = [t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8"))
               for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    pairs = ([tuple(m.split(" ", 1)) for m in merges] if merges is not None
             else derive_merges(vocab, None))
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False))  # type: ignore[arg-type]
    if pre in REGEX_SPLITS:
        split: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(REGEX_SPLITS[str(pre)]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    else:
        digits = [pre_tokenizers.Digits(individual_digits=True)] if DIGIT_SPLITS[str(pre)] else []
        split = [*digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(split)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, spelled


def _sentencepiece(tokens: list[str], merges: list[str] | None,
                   scores: list[float] | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = ([tuple(m.split(" ", 1)) for m in merges] if merges is not None
             else derive_merges(vocab, dict(zip(tokens, scores or []))))
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True,  # type: ignore[arg-type]
                              byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                       split=False)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])     # the space the pre-tokenizer prepended
    return tokenizer


def derive_merges(vocab: Mapping[str, int], scores: Mapping[str, float] | None,
                  ) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: every split of a token into two tokens, best first.
    With scores (SentencePiece), higher scores merge first; without, lower ids do. Ties go to
    the longer left piece, then the longer right one, then to file order (transformers'
    order, so both build the same tokenizer)."""
    ranked = scores if scores is not None else {t: float(i) for t, i in vocab.items()}
    found: list[tuple[str, str, float]] = []
    for token, score in ranked.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    # A stable sort, descending with scores, ascending by id without (as the key says).
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=scores is not None)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(tokenizer: Tokenizer, tokens: Sequence[str], spelled: Sequence[str],
                        types: Sequence[int], named: set[str]) -> None:
    """Control and named tokens special, user-defined ones plain; all matched whole. Only
    tokens the vocabulary spells as the file does: a byte-level control token with another
    character is a mislabel of llama.cpp's, and its respelled form is what the merges use."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, s, kind in zip(tokens, spelled, types)
               if t == s and (kind == CONTROL or t in named)]
    tokenizer.add_special_tokens(special)
    plain = [AddedToken(t, special=False, normalized=False)
             for t, s, kind in zip(tokens, spelled, types)
             if t == s and kind == USER_DEFINED and t not in named]
    if plain:
        tokenizer.add_tokens(plain)


def _chat_templates(path: Path, fields: Mapping[str, object]) -> dict[str, str]:
    """`tokenizer.chat_template` ("default") and llama.cpp's named ones,
    `tokenizer.chat_template.<name>` (e.g. "tool_use")."""
    templates = {}
    for key, text in fields.items():
        if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template."):
            if not isinstance(text, str):
                raise ValueError(f"{path}: {key} is not a string")
            templates[key.removeprefix("tokenizer.chat_template").lstrip(".") or "default"] = text
    return templates
