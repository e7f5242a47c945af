"""Our GGUF tokenizer against transformers' GGUF tokenizer on the same file."""

import pytest

from scheduler_svc.frontend.tokenizer import ChatMessage, TemplateError

TEXTS = [
    "Hello, world! How are you?",
    "<|im_start|>user\nWhat is 2+2? Answer in 12345 words.<|im_end|>\n",
    "  leading spaces\n\n\ttabs, émojis 🎉, naïve café, 日本語",
    "don't won't I'll they're",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    # A completion's prompt: SmolLM2's GGUF says add_bos_token = false, so no BOS either way.
    assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ours = tokenizer.render_chat([ChatMessage(**m) for m in messages], True)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


def test_special_tokens_are_single_ids(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert 2 in tokenizer.special_ids
    assert tokenizer.decode([2], skip_special_tokens=True) == ""


def test_no_template_is_a_clear_error(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from scheduler_svc.frontend.tokenizer import TextTokenizer

    bare = TextTokenizer(tokenizer.tokenizer, None, None, None)
    with pytest.raises(TemplateError, match="no chat template"):
        bare.render_chat([ChatMessage("user", "x")], True)


# ---------------------------------------------------------------- tokenizer.ggml.pre strictness


def write_tokenizer_gguf(path, pre: str | None):  # type: ignore[no-untyped-def]
    """A GGUF holding only a tiny byte-level BPE vocabulary."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab", "1", "2", "<|end|>"])
    writer.add_token_types([1, 1, 1, 1, 1, 3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["default", "deepseek-llm"])
def test_unknown_pre_tokenizer_is_refused(tmp_path, pre: str) -> None:  # type: ignore[no-untyped-def]
    from scheduler_svc.frontend.tokenizer import load_tokenizer

    path = write_tokenizer_gguf(tmp_path / "t.gguf", pre)
    with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.pre '{pre}' is not supported "
                                         r"\(supported: .*gpt-2, .*llama-bpe, .*qwen2, .*smollm"):
        load_tokenizer(path)


def test_missing_pre_tokenizer_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from scheduler_svc.frontend.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre is missing"):
        load_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", None))


@pytest.mark.parametrize("pre, ids", [("gpt-2", [2, 3, 4]), ("smollm", [2, 3, 4]),
                                      ("llama-bpe", [2, 3, 4]), ("qwen2", [2, 3, 4])])
def test_supported_pre_tokenizers_load(tmp_path, pre: str, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    from scheduler_svc.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", pre))
    assert tok.encode("ab12") == ids
    assert tok.encode("<|end|>") == [5]


def test_max_token_bytes_is_the_longest_token(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # SmolLM2's longest token is a newline and 80 spaces.
    assert tokenizer.max_token_bytes == 81
    longest = "\n" + " " * 80
    assert len(tokenizer.encode(longest)) == 1
