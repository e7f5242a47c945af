"""Our GGUF tokenizer against transformers' GGUF tokenizer on the same file."""

import pytest

from scheduler_svc.tokenizer import ChatMessage, TemplateError

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
    from scheduler_svc.tokenizer import TextTokenizer

    bare = TextTokenizer(tokenizer.tokenizer, None, None, None)
    with pytest.raises(TemplateError, match="no chat template"):
        bare.render_chat([ChatMessage("user", "x")], True)
