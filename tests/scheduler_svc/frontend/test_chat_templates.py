"""Each family's chat template as our tokenizer renders it (scheduler_svc/frontend/
tokenizer.py) against transformers' `apply_chat_template` on the same tokenizer_config.json.
The templates in chat_templates/ are written for these tests in the three styles the families
use: ChatML with Qwen's extras (namespace, tojson of tools, loop controls), Llama 3
(bos_token, strftime_now, trim, break) and Mistral's [INST] (raise_exception on bad role
order, the generation tag)."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from scheduler_svc.frontend.tokenizer import ChatMessage, TemplateError, load_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
SPECIALS = {"chatml_qwen": ("<|endoftext|>", "<|im_end|>"),
            "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
            "mistral_inst": ("<s>", "</s>")}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi! Ça va?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
]


def tokenizer_dir(tmp_path: Path, name: str) -> Path:
    bos, eos = SPECIALS[name]
    path = tmp_path / name
    path.mkdir()
    vocab = {tok: i for i, tok in enumerate(["<unk>", bos, eos, "<pad>", "a", "b"])}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": (TEMPLATES / f"{name}.jinja").read_text()}))
    return path


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("name", list(SPECIALS))
def test_templates_render_as_transformers_renders_them(
        tmp_path: Path, name: str, conversation: int, generation_prompt: bool) -> None:
    from transformers import AutoTokenizer

    path = tokenizer_dir(tmp_path, name)
    messages = CONVERSATIONS[conversation]
    theirs = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)
    ours = load_tokenizer(path).render_chat([ChatMessage(**m) for m in messages],
                                            generation_prompt)
    assert ours == theirs
    assert SPECIALS[name][0] in ours or name == "chatml_qwen"


def test_a_template_refusing_the_roles_is_a_template_error(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path, "mistral_inst"))
    with pytest.raises(TemplateError, match="alternate"):
        tokenizer.render_chat([ChatMessage("assistant", "first")], True)
