"""The scheduler's tokenizer: built from a GGUF file's vocabulary or an HF `tokenizer.json`,
plus the model's chat template.

GGUF byte-level BPE (`tokenizer.ggml.model == "gpt2"`) becomes a `tokenizers` BPE with the
GPT-2 byte alphabet; the control tokens (token type 3) become special tokens. The pre-tokenizer
follows `tokenizer.ggml.pre`: "smollm" splits every digit on its own before the GPT-2 split, as
SmolLM2's own tokenizer.json does. Any other value (or none) is refused: the merges were learned
on that value's own split, and a different split gives other token ids without any error.
tests/scheduler_svc/frontend/test_tokenizer.py checks the result against transformers' GGUF
tokenizer.

Chat templates render as transformers' `apply_chat_template` renders them
(tests/scheduler_svc/frontend/test_chat_templates.py): a sandboxed Jinja with trim_blocks /
lstrip_blocks, loop controls (`break`, `continue`), a `{% generation %}` block (marks
assistant text for training masks; rendered as is), `tojson` without ASCII or HTML escaping,
`strftime_now` and `raise_exception`; the variables are the messages (role and content, plus
name, tool_calls and tool_call_id where given), `add_generation_prompt`, `tools` and
`documents` (None unless the request gives them) and the special tokens of
tokenizer_config.json.

The model's own template can be replaced (`--chat-template`: a file, or the template inline);
a template that does not compile is refused when the tokenizer is built, so the scheduler
stops at start-up with the parse error instead of failing every chat.

`encode` runs through `encode_batch`, which releases the GIL: the frontend tokenizes in a
thread, and a long prompt must not stall the event loop that serves every other client.
"""

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from services.gguf_file import GgufFile

CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4

# Pre-tokenizer splits that run before the GPT-2 byte-level split, by GGUF
# `tokenizer.ggml.pre` (llama.cpp's names). Only values whose split is exactly this are listed.
_DIGIT_SPLIT = pre_tokenizers.Digits(individual_digits=True)
_PRE_SPLITS: dict[str, list[pre_tokenizers.PreTokenizer]] = {
    "gpt-2": [], "smollm": [_DIGIT_SPLIT], "starcoder": [_DIGIT_SPLIT], "refact": [_DIGIT_SPLIT]}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None              # role "tool": the call it answers
    tool_calls: list[dict[str, Any]] | None = None   # role "assistant": its calls, as JSON

    def to_template(self) -> dict[str, Any]:
        """The message as the template sees it: only the keys that are set (templates test
        `message.tool_calls is defined`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            message["tool_calls"] = self.tool_calls
        return message


class TemplateError(ValueError):
    """The chat template is missing or failed to render the messages."""


class TextTokenizer:
    """Encode/decode plus chat-template rendering; immutable after construction."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None,
                 bos_token: str | None, eos_token: str | None,
                 other_special_tokens: Mapping[str, str] | None = None) -> None:
        """`other_special_tokens`: more template variables, e.g. pad_token / unk_token."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._special_tokens = {**(other_special_tokens or {}), "bos_token": bos_token or "",
                                "eos_token": eos_token or ""}
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # UTF-8 bytes of the longest token's text (a partial character decodes to U+FFFD, 3
        # bytes, which only overestimates): no prompt of N tokens is longer than N times this.
        self.max_token_bytes = max(
            (len(t.encode("utf-8")) for t in tokenizer.decode_batch(
                [[i] for i in range(self.vocab_size)], skip_special_tokens=False)), default=1)
        self.special_ids = frozenset(
            tid for tok, tid in tokenizer.get_vocab(with_added_tokens=True).items()
            if tok in {t.content for t in tokenizer.get_added_tokens_decoder().values()
                       if t.special})
        self._template = _compile_template(chat_template) if chat_template else None

    def with_chat_template(self, chat_template: str) -> "TextTokenizer":
        """The same tokenizer rendering chats with `chat_template` (compiled here)."""
        return TextTokenizer(self.tokenizer, chat_template, self.bos_token, self.eos_token,
                             {k: v for k, v in self._special_tokens.items()
                              if k not in ("bos_token", "eos_token")})

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: a 1 MB prompt froze
        # every other thread for a second).
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    documents: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            raise TemplateError("the model has no chat template; send text or token ids")
        try:
            return self._template.render(
                messages=[m.to_template() for m in messages],
                add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
                **self._special_tokens)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks the assistant's tokens with it (for
    training masks); for inference its body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body,
                                      lineno=lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _to_json(value: object, ensure_ascii: bool = False, indent: int | None = None,
             separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Jinja's own tojson escapes HTML characters; templates expect plain JSON."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _to_json
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not parse: {exc}") from exc


def read_chat_template(value: str) -> str:
    """`--chat-template`'s value: a file's text, or the template itself when it looks like
    one (has a brace or a newline). Anything else is a ValueError (a mistyped path must not
    become a template that renders its own name)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--chat-template {value!r}: {exc}") from exc
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a template")


def load_tokenizer(model_path: str | Path, chat_template: str | None = None) -> TextTokenizer:
    """`chat_template`: a template (text) to use instead of the model's own. Raises
    ValueError (TemplateError for a template that does not compile)."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        tokenizer = _from_gguf(path)
    elif path.is_dir() and (path / "tokenizer.json").is_file():
        tokenizer = _from_hf_dir(path)
    else:
        raise ValueError(f"{path}: no tokenizer found (expected .gguf or a dir with "
                         "tokenizer.json)")
    if chat_template is None:
        return tokenizer
    try:
        return tokenizer.with_chat_template(chat_template)
    except TemplateError as exc:
        raise TemplateError(f"--chat-template: {exc}") from exc


def _from_gguf(path: Path) -> TextTokenizer:
    fields = GgufFile(path).fields

    def value(name: str) -> object | None:
        found = fields.get(name)
        return found.tolist() if isinstance(found, np.ndarray) else found

    model = value("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer model {model!r} is not supported (gpt2 BPE only)")
    tokens: list[str] = value("tokenizer.ggml.tokens")  # type: ignore[assignment]
    token_types: list[int] = value("tokenizer.ggml.token_type") or []  # type: ignore[assignment]
    merges: list[str] = value("tokenizer.ggml.merges") or []  # type: ignore[assignment]

    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],  # type: ignore[misc]
              fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*_pre_splits(path, value), byte_level])
    tokenizer.decoder = decoders.ByteLevel()

    byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    specials = [AddedToken(tok, special=True, normalized=False)
                for tok, kind in zip(tokens, token_types)
                if kind == CONTROL_TOKEN_TYPE and set(tok) <= byte_alphabet]
    tokenizer.add_special_tokens(specials)
    user_defined = [AddedToken(tok, special=False, normalized=False)
                    for tok, kind in zip(tokens, token_types) if kind == USER_DEFINED_TOKEN_TYPE]
    if user_defined:
        tokenizer.add_tokens(user_defined)

    def token_name(key: str) -> str | None:
        tid = value(key)
        return tokens[int(tid)] if tid is not None else None  # type: ignore[call-overload]

    return TextTokenizer(tokenizer, value("tokenizer.chat_template"),  # type: ignore[arg-type]
                         token_name("tokenizer.ggml.bos_token_id"),
                         token_name("tokenizer.ggml.eos_token_id"))


def _pre_splits(path: Path, value: Callable[[str], object | None],
                ) -> list[pre_tokenizers.PreTokenizer]:
    pre = value("tokenizer.ggml.pre")
    supported = ", ".join(sorted(_PRE_SPLITS))
    if pre is None:
        raise ValueError(f"{path}: tokenizer.ggml.pre is missing, so the text split its merges "
                         f"expect is unknown (supported: {supported})")
    if pre not in _PRE_SPLITS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                         f"{supported}); another split would give wrong token ids")
    return _PRE_SPLITS[str(pre)]


def _from_hf_dir(path: Path) -> TextTokenizer:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg: dict[str, object] = {}
    if (path / "tokenizer_config.json").is_file():
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()

    def token_name(key: str) -> str | None:
        tok = cfg.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return tok if isinstance(tok, str) else None

    others = {key: name for key in ("pad_token", "unk_token", "sep_token", "cls_token",
                                    "mask_token") if (name := token_name(key)) is not None}
    return TextTokenizer(tokenizer, template if isinstance(template, str) else None,
                         token_name("bos_token"), token_name("eos_token"), others)
