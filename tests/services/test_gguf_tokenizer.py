"""services/gguf_tokenizer.py against transformers' own GGUF tokenizer
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, what vLLM serves a GGUF with) on tiny
files of each kind: byte-level BPE under every `tokenizer.ggml.pre` split we build, and
SentencePiece with merges derived from scores or given. Token ids with and without special
tokens (BOS / EOS), decoded text, special tokens."""

import json
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from services.gguf_file import GgufFile
from services.gguf_tokenizer import (
    REGEX_SPLITS,
    byte_alphabet,
    derive_merges,
    tokenizer_from_gguf,
)

CORPUS = [
    "Hello, world! How are you? The quick brown fox jumps over the lazy dog.",
    "Numbers: 12345 67890 2024 3.14159 and 1000000; phone 555-1234.",
    "def f(x):\n    return x ** 2  # comment\n\n\tindented\r\n",
    "naïve café résumé 日本語のテキスト 中文 한국어 Привет мир émojis 🎉🚀",
    "don't won't I'll they're we've she'd it's DON'T",
    "  leading spaces and    runs   of spaces\n\n\n",
    "Combining marks: e\u0301 a\u0308 Hindi नमस्ते",
] * 10

TEXTS = [
    "Hello, world! How are you?",
    "",
    " ",
    "   leading spaces\n\n\ttabs   and runs  ",
    "Digits 1234567890 12 123 1234 3.14159",
    "naïve café 日本語 🎉 Привет नमस्ते e\u0301",
    "don't WON'T I'll they're",
    "def f(x):\n    return x ** 2  # comment\r\n",
    "<|im_start|>user\nHi<|im_end|>\n<think>hmm</think>",
    "a<|im_end|>b <|im_start|> c",
    "<s>Hello</s> world",
    "unseen: ÿ ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<think>", "</think>"]
SPECIAL_TYPES = [3, 3, 3, 4, 4]


def _train(pre: pre_tokenizers.PreTokenizer, size: int, alphabet: list[str]) -> dict:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=size, initial_alphabet=alphabet, show_progress=False))
    return json.loads(tok.to_str())["model"]


def _write(path: Path, arch: str, kind: str, tokens: list[str], types: list[int],
           **extra: object) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name, value in extra.items():
        if value is not None:
            getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_gguf(path: Path, pre: str, arch: str = "llama", add_bos: bool | None = None,
                    add_eos: bool | None = None) -> Path:
    """A byte-level BPE vocabulary trained on CORPUS (multi-digit merges included, so the
    splits' digit rules show), with control and user-defined tokens."""
    model = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), 600,
                   pre_tokenizers.ByteLevel.alphabet())
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    n = len(tokens)
    return _write(path, arch, "gpt2", tokens + SPECIALS, [1] * n + SPECIAL_TYPES,
                  tokenizer_pre=pre, token_merges=merges, bos_token_id=n + 2,
                  eos_token_id=n + 1, add_bos_token=add_bos, add_eos_token=add_eos)


def sentencepiece_gguf(path: Path, add_bos: bool | None = None, add_eos: bool | None = None,
                       with_merges: bool = False) -> Path:
    """A Llama-2-style vocabulary: <unk> <s> </s>, the 256 byte pieces, pieces scored by merge
    rank, single characters last; no merges unless `with_merges`."""
    model = _train(pre_tokenizers.Metaspace(), 500, [])
    ranked = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merged = [t for t, _ in ranked if len(t) > 1]
    chars = [t for t, _ in ranked if len(t) == 1]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *merged, *chars,
              *SPECIALS]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(merged) + len(chars)) + SPECIAL_TYPES
    scores = ([0.0] * 259 + [-float(i) for i in range(len(merged))]
              + [-1e4 - i for i in range(len(chars))] + [0.0] * len(SPECIALS))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return _write(path, "llama", "llama", tokens, types, token_scores=scores,
                  token_merges=merges if with_merges else None, bos_token_id=1,
                  eos_token_id=2, unk_token_id=0, add_bos_token=add_bos,
                  add_eos_token=add_eos)


def _ours(path: Path):  # type: ignore[no-untyped-def]
    return tokenizer_from_gguf(path, GgufFile(path).fields)


def _theirs(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_as_transformers(path: Path) -> None:
    ours, theirs = _ours(path), _theirs(path)
    tok = ours.tokenizer
    for text in TEXTS:
        for special in (False, True):
            expected = theirs.encode(text, add_special_tokens=special)
            got = tok.encode(text, add_special_tokens=special).ids
            assert got == expected, (text, special)
        ids = theirs.encode(text, add_special_tokens=True)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip), (text, skip)
    assert ours.bos_token == theirs.bos_token
    assert ours.eos_token == theirs.eos_token
    their_specials = {t.content for t in theirs.added_tokens_decoder.values() if t.special}
    our_specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    # transformers' byte-level builder adds GPT-2's <|endoftext|> as an id past the file's
    # vocabulary; we leave it out (see the module's docstring).
    assert our_specials == their_specials - {"<|endoftext|>"}


@pytest.mark.parametrize("pre", sorted(REGEX_SPLITS) + ["gpt-2"])
def test_byte_level_splits_match_transformers(tmp_path: Path, pre: str) -> None:
    assert_same_as_transformers(byte_level_gguf(tmp_path / "t.gguf", pre, add_bos=True))


@pytest.mark.parametrize("arch, pre, add_bos, add_eos", [
    ("llama", "llama-bpe", None, None), ("llama", "llama-bpe", False, True),
    ("qwen2", "qwen2", False, None), ("qwen2", "qwen2", True, None),
    ("qwen3", "qwen2", None, None)])
def test_byte_level_bos_eos_match_transformers(tmp_path: Path, arch: str, pre: str,
                                               add_bos: bool | None,
                                               add_eos: bool | None) -> None:
    path = byte_level_gguf(tmp_path / "t.gguf", pre, arch, add_bos, add_eos)
    assert_same_as_transformers(path)
    ids = _ours(path).tokenizer.encode("Hi", add_special_tokens=True).ids
    plain = _ours(path).tokenizer.encode("Hi", add_special_tokens=False).ids
    bos, eos = _ours(path).tokenizer.token_to_id("<|begin_of_text|>"), \
        _ours(path).tokenizer.token_to_id("<|im_end|>")
    assert ids == [bos] * bool(add_bos) + plain + [eos] * bool(add_eos)


@pytest.mark.parametrize("add_bos, add_eos, with_merges", [
    (None, None, False), (True, None, False), (False, True, False), (True, None, True)])
def test_sentencepiece_matches_transformers(tmp_path: Path, add_bos: bool | None,
                                            add_eos: bool | None, with_merges: bool) -> None:
    path = sentencepiece_gguf(tmp_path / "t.gguf", add_bos, add_eos, with_merges)
    assert_same_as_transformers(path)
    ids = _ours(path).tokenizer.encode("Hello world", add_special_tokens=True).ids
    # A missing add_bos_token means BOS for a SentencePiece vocabulary.
    assert (ids[0] == 1) == (add_bos is not False)
    assert (ids[-1] == 2) == bool(add_eos)


def test_sentencepiece_bytes_and_spaces(tmp_path: Path) -> None:
    tok = _ours(sentencepiece_gguf(tmp_path / "t.gguf")).tokenizer
    ids = tok.encode("☃", add_special_tokens=False).ids
    # Not in the vocabulary: its UTF-8 bytes as byte pieces (after the prepended "▁").
    assert [tok.id_to_token(i) for i in ids][-3:] == ["<0xE2>", "<0x98>", "<0x83>"]
    # (A text that starts with spaces loses one: Metaspace prepends "▁" only to text that does
    # not start with one, and the decoder strips one; transformers' tokenizer does the same.)
    for text in ["trailing  ", "a\n\nb", "runs   of  spaces"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_byte_alphabet_is_gpt2s() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_alphabet() == bytes_to_unicode()
    assert set(byte_alphabet().values()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_derive_merges_matches_transformers() -> None:
    from transformers.tokenization_utils_base import generate_merges

    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "bca"])}
    scores = {t: s for t, s in zip(vocab, [0, 0, 0, -1.0, -1.0, -2.0, -3.0, -2.0, -2.0])}
    assert derive_merges(vocab, scores) == generate_merges(vocab, scores)
    assert derive_merges(vocab, None) == generate_merges(vocab)


def test_respelled_tokens(tmp_path: Path) -> None:
    """A byte-level token written with characters outside the byte alphabet is respelled into
    it (and a control token so written is not special), as transformers does."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    path = _write(tmp_path / "t.gguf", "llama", "gpt2", [*alphabet, "a b", "<ctl x>"],
                  [1] * len(alphabet) + [1, 3], tokenizer_pre="llama-bpe", token_merges=[])
    parts = _ours(path)
    assert parts.tokenizer.token_to_id("aĠb") == len(alphabet)
    assert parts.tokenizer.get_added_tokens_decoder() == {}


@pytest.mark.parametrize("fields, message", [
    ({"tokenizer.ggml.model": "bert"}, r"tokenizer\.ggml\.model 'bert' is not supported"),
    ({"tokenizer.ggml.model": "gpt2"}, r"tokenizer\.ggml\.tokens is missing"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]},
     r"tokenizer\.ggml\.pre is missing"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
      "tokenizer.ggml.pre": "deepseek-llm"},
     r"tokenizer\.ggml\.pre 'deepseek-llm' is not supported \(supported: .*llama-bpe.*qwen2"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"],
      "tokenizer.ggml.scores": [0.0]}, r"tokenizer\.ggml\.scores must give one score"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"],
      "general.architecture": "gemma2"},
     r"SentencePiece vocabulary of architecture 'gemma2' is built differently"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
      "tokenizer.ggml.token_type": [1, 1]}, r"token_type has 2 entries for 1 tokens"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.pre":
      "gpt-2", "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": 5},
     r"tokenizer\.ggml\.eos_token_id 5 is outside the vocabulary of 1"),
])
def test_bad_fields_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tokenizer_from_gguf(Path("m.gguf"), fields)


def test_named_chat_templates() -> None:
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
              "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.merges": [],
              "tokenizer.chat_template": "plain", "tokenizer.chat_template.tool_use": "tools"}
    parts = tokenizer_from_gguf(Path("m.gguf"), fields)
    assert parts.chat_templates == {"default": "plain", "tool_use": "tools"}
