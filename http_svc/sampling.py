"""OpenAI request parameters onto the engine's sampling parameters, as vLLM's OpenAI server
maps them: the one place that says which parameters the engine honours, with what defaults,
and which it does not have yet.

Defaults, as vLLM's (with no generation config of the model's own): temperature 1.0, top_p
1.0, top_k 0 (off), min_tokens 0; completions' max_tokens 16 (null: the rest of the context);
chat's max_completion_tokens (or the deprecated max_tokens) the rest of the context; `stop` a
string or a list; chat's logprobs a bool with top_logprobs alternatives, completions' logprobs
the number of alternatives. Seeds are int64 as in vLLM; the engine takes their 64 bits.

`NOT_YET` lists what the engine cannot do yet. Such a parameter is accepted at its neutral
value (`presence_penalty: 0`, `n: 1`, `echo: false`) and otherwise
refused with a 400 that names it. When the engine gains one, its line leaves `NOT_YET` and
one line in `_sampling` carries it.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from http_svc.errors import bad_request, not_supported
from http_svc.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from http_svc.structured import Structured, structured_output
from services.wire import MAX_TOP_LOGPROBS

INT32_MAX = (1 << 31) - 1   # the engine's token counts are int32
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64 = 1 << 64


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a GenerateRequest's `sampling` (and `keep_special_tokens`) will carry."""

    temperature: float
    top_p: float
    top_k: int                       # -1 or 0: off
    seed: int | None                 # uint64; None: the engine picks one
    max_tokens: int | None           # None: the rest of the context after the prompt
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None             # alternatives per sampled token; None: no logprobs
    keep_special_tokens: bool
    structured: Structured | None = None   # response_format / guided_* (http_svc.structured)


@dataclass(frozen=True, slots=True)
class NotYet:
    """A parameter the engine does not have yet: accepted only at a neutral value. A value
    outside `valid` is refused as invalid first (`domain` says what is valid)."""

    name: str
    neutral: Callable[[Any], bool]
    neutral_text: str                  # the neutral value(s), for the message
    valid: Callable[[Any], bool] | None = None
    domain: str = ""


def _unset(value: Any) -> bool:
    return value is None


def _falsy(value: Any) -> bool:
    return not value


NOT_YET: tuple[NotYet, ...] = (
    NotYet("min_p", lambda v: v in (None, 0), "0", lambda v: 0 <= v <= 1, "in [0, 1]"),
    NotYet("presence_penalty", lambda v: v in (None, 0), "0", lambda v: -2 <= v <= 2,
           "in [-2, 2]"),
    NotYet("frequency_penalty", lambda v: v in (None, 0), "0", lambda v: -2 <= v <= 2,
           "in [-2, 2]"),
    NotYet("repetition_penalty", lambda v: v in (None, 1), "1", lambda v: v > 0, "> 0"),
    NotYet("logit_bias", _falsy, "{}"),
    NotYet("n", lambda v: v in (None, 1), "1", lambda v: v >= 1, ">= 1"),
    NotYet("best_of", lambda v: v in (None, 1), "1", lambda v: v >= 1, ">= 1"),
    NotYet("echo", _falsy, "false"),
    NotYet("suffix", _falsy, "null"),
    NotYet("prompt_logprobs", _unset, "null"),
    NotYet("include_stop_str_in_output", _falsy, "false"),
    NotYet("guided_grammar", _unset, "null"),
)


def refuse_not_yet(request: GenerationFields) -> None:
    """ApiError (400) naming the first parameter the engine cannot honour yet."""
    fields = type(request).model_fields
    for entry in NOT_YET:
        if entry.name not in fields:
            continue
        value = getattr(request, entry.name)
        if value is not None and entry.valid is not None and not entry.valid(value):
            raise bad_request(f"{entry.name} must be {entry.domain}, got {value}", entry.name)
        if not entry.neutral(value):
            raise not_supported(entry.name, f"only {entry.neutral_text} is accepted")
    options = request.stream_options
    if options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if options is not None and options.continuous_usage_stats:
        raise not_supported("stream_options.continuous_usage_stats", "only false is accepted")


def completion_sampling(request: CompletionRequest) -> Sampling:
    refuse_not_yet(request)
    logprobs = request.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}",
                          "logprobs")
    return _sampling(request, request.max_tokens, "max_tokens", logprobs)


def chat_sampling(request: ChatCompletionRequest) -> Sampling:
    refuse_not_yet(request)
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                          "top_logprobs")
    if top and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if request.max_completion_tokens is not None:
        max_tokens, name = request.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, name = request.max_tokens, "max_tokens"
    return _sampling(request, max_tokens, name, (top or 0) if request.logprobs else None)


def _sampling(request: GenerationFields, max_tokens: int | None, max_tokens_name: str,
              logprobs: int | None) -> Sampling:
    temperature = 1.0 if request.temperature is None else request.temperature
    if not (math.isfinite(temperature) and temperature >= 0):
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if request.top_k is None else request.top_k
    if not -1 <= top_k <= INT32_MAX:
        raise bad_request(f"top_k must be -1 or 0 (off) or >= 1, got {top_k}", "top_k")
    if max_tokens is not None and not 1 <= max_tokens <= INT32_MAX:
        raise bad_request(f"{max_tokens_name} must be at least 1, got {max_tokens}",
                          max_tokens_name)
    min_tokens = request.min_tokens
    if not 0 <= min_tokens <= (INT32_MAX if max_tokens is None else max_tokens):
        raise bad_request(f"min_tokens must be in [0, {max_tokens_name}], got {min_tokens}",
                          "min_tokens")
    seed = request.seed
    if seed is not None and not INT64_MIN <= seed <= INT64_MAX:
        raise bad_request(f"seed must be a 64-bit signed integer, got {seed}", "seed")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    if any(not s for s in stop):
        raise bad_request("stop must not contain an empty string", "stop")
    return Sampling(
        temperature=temperature, top_p=top_p, top_k=top_k,
        seed=None if seed is None else seed % UINT64,
        max_tokens=max_tokens, min_tokens=min_tokens, stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        logprobs=logprobs, keep_special_tokens=not request.skip_special_tokens,
        structured=structured_output(request))
