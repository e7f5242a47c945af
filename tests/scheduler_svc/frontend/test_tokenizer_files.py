"""Loading a tokenizer from an HF directory as transformers does (scheduler_svc/frontend/
tokenizer.py): BOS / EOS for a completion's prompt from tokenizer.json or tokenizer_config's
flags, the chat template given as a list of named templates, and `--tokenizer` replacing the
model's own tokenizer."""

import json
from pathlib import Path

import pytest

from scheduler_svc.frontend.tokenizer import ChatMessage, TemplateError, load_tokenizer
from tests.services.test_gguf_tokenizer import TEXTS, byte_level_gguf, sentencepiece_gguf

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds",
                                           "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def hf_dir_from_gguf(tmp_path: Path, gguf: Path, **config: object) -> Path:
    """transformers' tokenizer of `gguf`, saved as an HF directory; `config` entries replace
    (None: remove) tokenizer_config.json's."""
    from transformers import AutoTokenizer

    out = tmp_path / "hf"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in config.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("json_bos, config_bos", [(True, None), (True, False), (False, True)])
def test_hf_dir_bos_matches_transformers(tmp_path: Path, json_bos: bool,
                                         config_bos: bool | None) -> None:
    """tokenizer.json's post-processor decides; transformers 5 ignores tokenizer_config's
    add_bos_token when it loads a directory, and so do we."""
    from transformers import AutoTokenizer

    gguf = sentencepiece_gguf(tmp_path / "sp.gguf", add_bos=json_bos)
    path = hf_dir_from_gguf(tmp_path, gguf, add_bos_token=config_bos)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text), text
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert (ours.encode("Hi", add_special_tokens=True)[0] == 1) == json_bos


def test_gguf_bos_for_completions(tmp_path: Path) -> None:
    tok = load_tokenizer(byte_level_gguf(tmp_path / "l3.gguf", "llama-bpe", add_bos=True))
    bos = tok.tokenizer.token_to_id("<|begin_of_text|>")
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.encode("Hello", add_special_tokens=True) == [bos, *tok.encode("Hello")]
    assert bos not in tok.encode("Hello")


def named_templates_dir(tmp_path: Path, names: list[str]) -> Path:
    path = hf_dir_from_gguf(tmp_path, byte_level_gguf(tmp_path / "q.gguf", "qwen2"))
    templates = {
        "default": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                   "assistant\n{% endif %}",
        "tool_use": "TOOLS {{ tools | tojson }}\n{% for m in messages %}{{ m.role }}: "
                    "{{ m.content }}\n{% endfor %}",
        "rag": "DOCS {% for m in messages %}{{ m.content }}{% endfor %}"}
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": n, "template": templates[n]} for n in names]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def test_chat_template_list_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = named_templates_dir(tmp_path, ["default", "tool_use", "rag"])
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    messages = [ChatMessage(**m) for m in MESSAGES]
    for tools in (None, TOOLS):
        expected = theirs.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                              add_generation_prompt=True)
        assert ours.render_chat(messages, True, tools) == expected
    assert ours.render_chat(messages, True).startswith("<|im_start|>user")
    assert ours.render_chat(messages, True, TOOLS).startswith("TOOLS [")
    assert ours.chat_template is not None and ours.chat_template.startswith("{% for m")


def test_chat_template_list_without_tool_use_uses_default(tmp_path: Path) -> None:
    ours = load_tokenizer(named_templates_dir(tmp_path, ["default"]))
    assert ours.render_chat([ChatMessage("user", "x")], False, TOOLS) == \
        "<|im_start|>user\nx<|im_end|>\n"


def test_chat_template_list_without_default_is_a_clear_error(tmp_path: Path) -> None:
    ours = load_tokenizer(named_templates_dir(tmp_path, ["tool_use"]))
    assert ours.render_chat([ChatMessage("user", "x")], False, TOOLS).startswith("TOOLS")
    with pytest.raises(TemplateError, match=r"templates \(tool_use\) include no 'default'"):
        ours.render_chat([ChatMessage("user", "x")], False)


def test_malformed_chat_template_list_is_refused(tmp_path: Path) -> None:
    path = named_templates_dir(tmp_path, ["default"])
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default"}]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"chat_template\[0\] is not"):
        load_tokenizer(path)


def test_tokenizer_flag_replaces_the_models(tmp_path: Path, model_path: Path) -> None:
    other = hf_dir_from_gguf(tmp_path, sentencepiece_gguf(tmp_path / "sp.gguf"))
    tok = load_tokenizer(model_path, tokenizer_path=other)
    assert tok.bos_token == "<s>"
    assert tok.vocab_size == load_tokenizer(other).vocab_size
    assert tok.encode("Hello") == load_tokenizer(other).encode("Hello")
    with pytest.raises(ValueError, match=r"--tokenizer .*nowhere: no tokenizer found"):
        load_tokenizer(model_path, tokenizer_path=tmp_path / "nowhere")


def test_completions_get_bos_and_chats_only_the_templates(tmp_path: Path) -> None:
    """As vLLM: a completion's prompt is encoded with special tokens (the tokenizer adds
    BOS), a rendered chat without (its template writes BOS once)."""
    import asyncio

    from scheduler_svc.frontend.prompts import PromptInput
    from scheduler_svc.frontend.validation import Limits, RawSampling
    from tests.scheduler_svc.frontend.fakes import make_frontend

    tok = load_tokenizer(byte_level_gguf(tmp_path / "l3.gguf", "llama-bpe", add_bos=True))
    tok = tok.with_chat_template("{{ bos_token }}{% for m in messages %}{{ m.content }}"
                                 "{% endfor %}")
    bos = tok.tokenizer.token_to_id("<|begin_of_text|>")
    frontend = make_frontend(tok, Limits("m", tok.vocab_size, 256))
    try:
        async def ids(prompt: PromptInput) -> list[int]:
            return (await frontend.prepare("", "m", prompt, RawSampling())).prompt_token_ids

        completion = asyncio.run(ids(PromptInput(text="Hello")))
        chat = asyncio.run(ids(PromptInput(chat=[ChatMessage("user", "Hello")])))
    finally:
        frontend.close()
    assert completion == [bos, *tok.encode("Hello")]
    assert chat == completion and chat.count(bos) == 1
