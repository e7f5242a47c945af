"""The HTTP API's request bodies, as pydantic models: field names, types and defaults as in
OpenAI's API and vLLM's OpenAI server. Only the shape lives here; what each value means for
the engine, and which ones it cannot honour yet, is `http_svc.sampling` and `http_svc.chat`.

Lenient where vLLM is lenient: a field a model does not declare is ignored, and
`ignored_fields` names them for one (rate-limited) warning, as vLLM logs them. Strict where it
is strict: a declared field with a value the engine cannot honour is a 400 that names it
(parameters the engine does not have yet are declared for that: the mapping refuses them by
name unless their value is the neutral one).
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.wire import MAX_CACHE_SALT_BYTES

TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]   # the API's token ids are uint32

# Sizes past which a field is refused (400 naming it and the limit) before anything is sent
# on: the scheduler refuses the same (scheduler_svc.frontend.validation, structured_output),
# and a list past these could not reach it inside gRPC's message size limit.
MAX_STOP_TOKEN_IDS = 1024      # stop_token_ids; with the EOS ids, within the wire's 2048
MAX_CHOICES = 1024             # guided_choice strings (structured_output.MAX_CHOICES)
MAX_ROLE_CHARS = 64            # a message's role; the scheduler takes a closed set of them


class StrictModel(BaseModel):
    """A request model that keeps undeclared fields aside (`model_extra`) instead of refusing
    them; the name stays from when they were refused."""

    model_config = ConfigDict(extra="allow")


def ignored_fields(model: BaseModel, path: str = "") -> list[str]:
    """The undeclared fields of `model` and of the request models inside it, as field paths
    (`messages[0].audio`)."""
    found = [f"{path}.{k}" if path else k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        where = f"{path}.{name}" if path else name
        if isinstance(value, BaseModel):
            found += ignored_fields(value, where)
        elif isinstance(value, list):
            found += [f for i, v in enumerate(value) if isinstance(v, BaseModel)
                      for f in ignored_fields(v, f"{where}[{i}]")]
    return found


class StreamOptions(StrictModel):
    include_usage: bool | None = False           # a last chunk with the usage, no choices
    # vLLM: usage on every chunk too (with include_usage), each choice's tokens so far
    continuous_usage_stats: bool | None = False


class GenerationFields(StrictModel):
    """What completions and chat completions share: the model, sampling, streaming."""

    model: str | None = None            # when set it must name the served model (else 404)
    temperature: float | None = None    # >= 0; default 1.0; below 1e-5 greedy
    top_p: float | None = None          # (0, 1]; default 1.0
    top_k: int | None = None            # vLLM: -1 or 0 off (the default); >= 1 keeps k
    min_p: float | None = None
    seed: int | None = None             # int64, as vLLM; the engine takes its 64 bits
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None             # accepted and ignored
    skip_special_tokens: bool = True    # vLLM: leave special tokens' text out of the output
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
    # prefix-cache salt (GenerateRequest.cache_salt); the scheduler bounds its UTF-8 bytes
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_BYTES)
    # OpenAI's bookkeeping fields, accepted and ignored as vLLM ignores them.
    metadata: dict[str, Any] | None = None
    store: bool | None = None


class CompletionRequest(GenerationFields):
    """POST /v1/completions."""

    # One text, a batch of texts, one token-id prompt or a batch of them.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16         # OpenAI's default; null: the rest of the context
    logprobs: int | None = None         # top alternatives per token, 0..20
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM: the tokenizer's own special tokens (a BOS) around the prompt
    # (http_svc.special_tokens)
    add_special_tokens: bool = True


class ChatMessageParam(StrictModel):
    role: str = Field(max_length=MAX_ROLE_CHARS)
    # Text, or a list of parts of which only {"type": "text", "text": ...} is taken.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An earlier reply's reasoning, sent back by clients; not shown to the template (vLLM).
    reasoning_content: str | None = None


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None       # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = None   # wins over max_tokens; both unset: the context
    logprobs: bool | None = False
    top_logprobs: int | None = None     # 0..20, with logprobs: true
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False    # vLLM: false for chat (the template has them)
    reasoning_effort: str | None = None   # OpenAI reasoning models: accepted, ignored


class TokenizeCompletionRequest(StrictModel):
    """POST /tokenize with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(StrictModel):
    """POST /tokenize with chat messages, rendered with the chat template."""

    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(StrictModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]
