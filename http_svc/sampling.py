"""OpenAI request parameters onto the engine's sampling parameters, as vLLM's OpenAI server
maps them: the one place that says which parameters the engine honours, with what defaults,
and which it does not have yet.

Defaults, as vLLM's: temperature, top_p, top_k, min_p and repetition_penalty left unset go
to the scheduler unset, which takes them from the model's generation_config.json
(--generation-config) or else vLLM's defaults (1.0, 1.0, off, 0, 1.0); min_tokens 0;
completions' max_tokens 16 (null: the rest of the context);
chat's max_completion_tokens (or the deprecated max_tokens) the rest of the context; `stop` a
string or a list; chat's logprobs a bool with top_logprobs alternatives, completions' logprobs
the number of alternatives; `include_stop_str_in_output` keeps a matched stop string in the
text (default false, as vLLM). Seeds are int64 as in vLLM; the engine takes their 64 bits.

Penalties and min_p as vLLM: presence/frequency in [-2, 2], repetition > 0, min_p in [0, 1];
logit_bias keys are token ids written as strings, values clamped to [-100, 100] as vLLM clamps
them. `n` choices come from one scheduler request (SamplingParams.n).

Sizes are bounded here, each refused with a 400 naming the field and the limit before the
request is sent on (the scheduler's own limits, so that none is left to gRPC's message size
limit): at most `MAX_STOP_STRINGS` stop strings of `MAX_STOP_LEN` characters, and output
constraints within the MAX_*_BYTES below; a schema sent as JSON text is measured for depth
before it is parsed (http_svc.json_limits). List lengths pydantic can bound are in
http_svc.protocol.

`NOT_YET` lists what the engine cannot do yet. Such a parameter is accepted at its neutral
value (`suffix: null`) and otherwise refused with a 400 that names it. `best_of` is served
when it equals `n` and refused by name above it, as vLLM V1 does.
When the engine gains one, its line leaves `NOT_YET` and one line in `_sampling`
carries it.
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from http_svc.errors import bad_request, not_supported
from http_svc.json_limits import MAX_JSON_DEPTH, nested_deeper_than
from http_svc.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
)
from http_svc.structured import MAX_SCHEMA_BYTES, Structured, structured_output
from services.wire import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_TOP_LOGPROBS

INT32_MAX = (1 << 31) - 1   # the engine's token counts are int32
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64 = 1 << 64
MAX_N = 64                  # choices per prompt, as the scheduler takes them
# As the scheduler takes them (scheduler_svc.frontend.validation, .structured_output).
MAX_STOP_STRINGS = 16       # stop strings per request
MAX_STOP_LEN = 256          # characters of one stop string
MAX_REGEX_BYTES = 16 << 10      # UTF-8 bytes of a regular expression
MAX_GRAMMAR_BYTES = 64 << 10    # UTF-8 bytes of an EBNF grammar
MAX_CHOICE_BYTES = 64 << 10     # UTF-8 bytes of a choice list's strings together


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a GenerateRequest's `sampling` (and `keep_special_tokens`) will carry."""

    # None in the five sampling knobs below: the client left it unset, and so does the
    # GenerateRequest; the scheduler fills it from the model's generation_config.json
    # (--generation-config) or else vLLM's default (temperature 1, top_p 1, top_k off,
    # min_p 0, repetition_penalty 1).
    temperature: float | None
    top_p: float | None
    top_k: int | None                # -1 or 0: off
    seed: int | None                 # uint64; None: the engine picks one
    max_tokens: int | None           # None: the rest of the context after the prompt
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None             # alternatives per sampled token; None: no logprobs
    keep_special_tokens: bool
    structured: Structured | None = None   # response_format / guided_* (http_svc.structured)
    n: int = 1                       # choices per prompt
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias), ids sorted
    prompt_logprobs: int | None = None   # alternatives per prompt token; None: none
    include_stop_str_in_output: bool = False   # a matched stop string stays in the text


@dataclass(frozen=True, slots=True)
class NotYet:
    """A parameter the engine does not have yet: accepted only at a neutral value. A value
    outside `valid` is refused as invalid first (`domain` says what is valid)."""

    name: str
    neutral: Callable[[Any], bool]
    neutral_text: str                  # the neutral value(s), for the message
    valid: Callable[[Any], bool] | None = None
    domain: str = ""


def _falsy(value: Any) -> bool:
    return not value


NOT_YET: tuple[NotYet, ...] = (
    NotYet("suffix", _falsy, "null"),
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


def completion_sampling(request: CompletionRequest) -> Sampling:
    refuse_not_yet(request)
    logprobs = request.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}",
                          "logprobs")
    sampling = _sampling(request, request.max_tokens, "max_tokens", logprobs)
    _check_best_of(request.best_of, sampling.n)
    if request.echo and logprobs is not None:   # the echoed prompt's logprobs (vLLM)
        sampling = dataclasses.replace(
            sampling, prompt_logprobs=max(sampling.prompt_logprobs or 0, logprobs))
    return sampling


def _check_best_of(best_of: int | None, n: int) -> None:
    """vLLM V1's best_of: served when it equals n (each of the n choices is returned, none
    ranked away); fewer than n is invalid, more is not served (V1 has no ranking either)."""
    if best_of is None or best_of == n:
        return
    if best_of < n:
        raise bad_request(f"best_of must be >= n ({n}), got {best_of}", "best_of")
    raise not_supported("best_of", f"only best_of == n ({n}) is served, got {best_of}")


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
    temperature, top_p, top_k = request.temperature, request.top_p, request.top_k
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if top_k is not None and not -1 <= top_k <= INT32_MAX:
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
    stop = _stop(request.stop)
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None:
        if not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                              f"{prompt_logprobs}", "prompt_logprobs")
        if request.stream:
            raise bad_request("prompt_logprobs is not available with stream: true (as in "
                              "vLLM)", "prompt_logprobs")
    n = 1 if request.n is None else request.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {n}", "n")
    return Sampling(
        temperature=temperature, top_p=top_p, top_k=top_k,
        seed=None if seed is None else seed % UINT64,
        max_tokens=max_tokens, min_tokens=min_tokens, stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        logprobs=logprobs, keep_special_tokens=not request.skip_special_tokens, n=n,
        min_p=_bounded(request.min_p, "min_p", None, 0.0, 1.0),
        presence_penalty=_bounded(request.presence_penalty, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_bounded(request.frequency_penalty, "frequency_penalty", 0.0,
                                   -2.0, 2.0),
        repetition_penalty=_repetition_penalty(request.repetition_penalty),
        logit_bias=_logit_bias(request.logit_bias), prompt_logprobs=prompt_logprobs,
        structured=_structured(request),
        include_stop_str_in_output=bool(request.include_stop_str_in_output))


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    stop = (value,) if isinstance(value, str) else tuple(value or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are "
                          "taken", "stop")
    for i, text in enumerate(stop):
        where = "stop" if isinstance(value, str) else f"stop[{i}]"
        if not text:
            raise bad_request("stop must not contain an empty string", "stop")
        if len(text) > MAX_STOP_LEN:
            raise bad_request(f"{where} is {len(text)} characters long; at most "
                              f"{MAX_STOP_LEN} are taken", "stop")
    return stop


def _structured(request: GenerationFields) -> Structured | None:
    """The output constraint, its sizes checked here (a 400 naming the field) rather than
    by gRPC's message size limit on the way to the scheduler. A schema sent as JSON text is
    measured for depth before it is parsed (http_svc.json_limits)."""
    texts = [("guided_json", request.guided_json)]
    if isinstance(request.structured_outputs, dict):
        texts.append(("structured_outputs.json", request.structured_outputs.get("json")))
    for name, text in texts:
        if isinstance(text, str) and nested_deeper_than(text, MAX_JSON_DEPTH):
            raise bad_request(f"{name} is nested deeper than {MAX_JSON_DEPTH} levels", name)
    structured = structured_output(request)
    if structured is None:
        return None
    param = structured.param
    limits = ((structured.json_schema, MAX_SCHEMA_BYTES, "its JSON schema"),
              (structured.regex, MAX_REGEX_BYTES, "its regular expression"),
              (structured.grammar, MAX_GRAMMAR_BYTES, "its grammar"),
              ("".join(structured.choice), MAX_CHOICE_BYTES, "its choices"))
    for text, limit, what in limits:
        num_bytes = 0 if text is None else len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > limit:
            raise bad_request(f"{param}: {what} is {num_bytes} bytes of UTF-8; at most {limit} "
                              "are taken", param)
    if len(structured.choice) > MAX_CHOICES:
        raise bad_request(f"{param} has {len(structured.choice)} choices; at most "
                          f"{MAX_CHOICES} are taken", param)
    return structured


def _bounded(value: float | None, name: str, default: float | None, low: float, high: float,
             ) -> float | None:
    if value is None:
        return default
    if not (math.isfinite(value) and low <= value <= high):
        raise bad_request(f"{name} must be in [{low:g}, {high:g}], got {value}", name)
    return value


def _repetition_penalty(value: float | None) -> float | None:
    if value is None:
        return None
    if not (math.isfinite(value) and value > 0):
        raise bad_request(f"repetition_penalty must be > 0, got {value}", "repetition_penalty")
    return value


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """Token ids from their string keys; values clamped to [-100, 100] (vLLM clamps). Ids
    outside the vocabulary are refused by the scheduler."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are "
                          "taken", "logit_bias")
    entries: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
        if not 0 <= token_id < 1 << 32:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary",
                              "logit_bias")
        if math.isnan(value):
            raise bad_request(f"logit_bias[{key}] must be a number, got {value}", "logit_bias")
        if token_id in entries:
            raise bad_request(f"logit_bias names token id {token_id} twice", "logit_bias")
        entries[token_id] = min(max(value, -MAX_LOGIT_BIAS_VALUE), MAX_LOGIT_BIAS_VALUE)
    return tuple(sorted(entries.items()))
