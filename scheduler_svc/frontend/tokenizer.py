"""The scheduler's tokenizer: built from a GGUF file's vocabulary or an HF `tokenizer.json`,
plus the model's chat template(s).

A GGUF's byte-level BPE (Llama 3, Qwen, SmolLM) or SentencePiece vocabulary is built by
services/gguf_tokenizer.py as transformers builds it. `--tokenizer PATH` (an HF tokenizer
directory or a GGUF) replaces the model's own tokenizer, as vLLM's flag does.

`encode(text, add_special_tokens=True)` is how a completion's prompt is tokenized (vLLM's
`add_special_tokens=True`): the tokenizer's post-processor adds BOS where the model asks for it
(GGUF `tokenizer.ggml.add_bos_token`; an HF directory's tokenizer.json, as transformers 5 reads
it). A rendered chat is encoded without: the template writes its own BOS.

A model may name several templates (tokenizer_config's `chat_template` as a list of
{"name", "template"}, `additional_chat_templates/*.jinja`, GGUF `tokenizer.chat_template.<name>`):
a chat renders with "tool_use" when the request gives tools and the model has it, else with
"default", as transformers picks.

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
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.gguf_file import GgufError, GgufFile
from services.gguf_tokenizer import TokenizerParts, tokenizer_from_gguf

DEFAULT_TEMPLATE, TOOL_TEMPLATE = "default", "tool_use"


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

    def __init__(self, tokenizer: Tokenizer, chat_template: str | Mapping[str, str] | None,
                 bos_token: str | None, eos_token: str | None,
                 other_special_tokens: Mapping[str, str] | None = None) -> None:
        """`chat_template`: one template, or templates by name ("default", "tool_use", ...).
        `other_special_tokens`: more template variables, e.g. pad_token / unk_token."""
        self.tokenizer = tokenizer
        templates = ({DEFAULT_TEMPLATE: chat_template} if isinstance(chat_template, str)
                     else dict(chat_template or {}))
        self.chat_templates = templates
        self.chat_template = templates.get(DEFAULT_TEMPLATE)
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
        self._templates = {name: _compile_template(text) for name, text in templates.items()}

    def with_chat_template(self, chat_template: str) -> "TextTokenizer":
        """The same tokenizer rendering chats with `chat_template` (compiled here)."""
        return TextTokenizer(self.tokenizer, chat_template, self.bos_token, self.eos_token,
                             {k: v for k, v in self._special_tokens.items()
                              if k not in ("bos_token", "eos_token")})

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: BOS / EOS as the model's post-processor adds them (a
        completion's prompt); a rendered chat has its own."""
        # encode_batch releases the GIL while it works (encode holds it: a 1 MB prompt froze
        # every other thread for a second).
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    documents: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """`template_kwargs`: more variables (a request's chat_template_kwargs, such as
        Qwen3's enable_thinking); they cannot replace the ones set here."""
        template = self._template_for(tools)
        try:
            return template.render(**{
                **(template_kwargs or {}), **self._special_tokens,
                "messages": [m.to_template() for m in messages],
                "add_generation_prompt": add_generation_prompt, "tools": tools,
                "documents": documents})
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def _template_for(self, tools: list[dict[str, Any]] | None) -> jinja2.Template:
        """"tool_use" for a request with tools where the model has it, else "default"."""
        if tools is not None and TOOL_TEMPLATE in self._templates:
            return self._templates[TOOL_TEMPLATE]
        if DEFAULT_TEMPLATE in self._templates:
            return self._templates[DEFAULT_TEMPLATE]
        if self._templates:
            raise TemplateError(f"the model's chat templates ({', '.join(self._templates)}) "
                                f"include no {DEFAULT_TEMPLATE!r} one for this request")
        raise TemplateError("the model has no chat template; send text or token ids")


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


def load_tokenizer(model_path: str | Path, chat_template: str | None = None,
                   tokenizer_path: str | Path | None = None) -> TextTokenizer:
    """The model's tokenizer, or `tokenizer_path`'s (`--tokenizer`: an HF tokenizer directory
    or a GGUF) instead. `chat_template`: a template (text) to use instead of the model's own.
    Raises ValueError (TemplateError for a template that does not compile)."""
    path = Path(tokenizer_path if tokenizer_path is not None else model_path)
    what = "--tokenizer " if tokenizer_path is not None else ""
    if path.is_file() and path.suffix == ".gguf":
        try:
            parts = tokenizer_from_gguf(path, GgufFile(path).fields)
        except GgufError as exc:
            raise ValueError(f"{what}{exc}") from exc
    elif path.is_dir() and (path / "tokenizer.json").is_file():
        parts = _from_hf_dir(path)
    else:
        raise ValueError(f"{what}{path}: no tokenizer found (expected .gguf or a dir with "
                         "tokenizer.json)")
    tokenizer = TextTokenizer(parts.tokenizer, parts.chat_templates, parts.bos_token,
                              parts.eos_token, parts.other_special_tokens)
    if chat_template is None:
        return tokenizer
    try:
        return tokenizer.with_chat_template(chat_template)
    except TemplateError as exc:
        raise TemplateError(f"--chat-template: {exc}") from exc


def _from_hf_dir(path: Path) -> TokenizerParts:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg: dict[str, object] = {}
    if (path / "tokenizer_config.json").is_file():
        cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))

    def token_name(key: str) -> str | None:
        tok = cfg.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return tok if isinstance(tok, str) else None

    bos, eos = token_name("bos_token"), token_name("eos_token")
    # BOS / EOS come from tokenizer.json's post-processor alone: transformers 5 leaves
    # tokenizer_config's add_bos_token / add_eos_token out when it loads a directory.
    others = {key: name for key in ("pad_token", "unk_token", "sep_token", "cls_token",
                                    "mask_token") if (name := token_name(key)) is not None}
    return TokenizerParts(tokenizer, bos, eos, others, _hf_chat_templates(path, cfg))


def _hf_chat_templates(path: Path, cfg: Mapping[str, object]) -> dict[str, str]:
    """tokenizer_config's `chat_template` (a template, or a list of {"name", "template"}), else
    chat_template.jinja; plus additional_chat_templates/<name>.jinja."""
    value = cfg.get("chat_template")
    if value is None and (path / "chat_template.jinja").is_file():
        value = (path / "chat_template.jinja").read_text(encoding="utf-8")
    templates: dict[str, str] = {}
    if isinstance(value, str):
        templates[DEFAULT_TEMPLATE] = value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ValueError(f"{path}: tokenizer_config.json chat_template[{i}] is not "
                                 '{"name": str, "template": str}')
            templates[item["name"]] = item["template"]
    elif value is not None:
        raise ValueError(f"{path}: tokenizer_config.json chat_template is neither a template "
                         "nor a list of named templates")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            templates.setdefault(file.stem, file.read_text(encoding="utf-8"))
    return templates
