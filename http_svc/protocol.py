"""The HTTP API's request bodies, as pydantic models: field names, types and defaults as in
OpenAI's API and vLLM's OpenAI server. Only the shape lives here; what each value means for
the engine, and which ones it cannot honour yet, is `http_svc.sampling` and `http_svc.chat`.

Every model forbids fields it does not declare, so an unknown field is a 400 that names it
(vLLM only logs those). Parameters the engine does not have yet are declared anyway: the
mapping refuses them by name unless their value is the neutral one.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]   # the API's token ids are uint32


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool | None = False           # a last chunk with the usage, no choices
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk (not yet)


class GenerationFields(StrictModel):
    """What completions and chat completions share: the model, sampling, streaming."""

    model: str | None = None            # when set it must name the served model (else 404)
    temperature: float | None = None    # >= 0; default 1.0; below 1e-5 greedy
    top_p: float | None = None          # (0, 1]; default 1.0
    top_k: int | None = None            # vLLM: -1 or 0 off (the default); >= 1 keeps k
    min_p: float | None = None
    seed: int | None = None             # int64, as vLLM; the engine takes its 64 bits
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
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
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = None       # prefix-cache salt (GenerateRequest.cache_salt)


class CompletionRequest(GenerationFields):
    """POST /v1/completions."""

    # One text, a batch of texts, one token-id prompt or a batch of them.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16         # OpenAI's default; null: the rest of the context
    logprobs: int | None = None         # top alternatives per token, 0..20
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessageParam(StrictModel):
    role: str
    # Text, or a list of parts of which only {"type": "text", "text": ...} is taken.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


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


class TokenizeCompletionRequest(StrictModel):
    """POST /tokenize with a text prompt."""

    model: str | None = None
    prompt: str
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
    return_token_strs: bool | None = False


class DetokenizeRequest(StrictModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]
