"""Request validation at the API edge: every bad input becomes one clear `InvalidRequest`
message (mapped to INVALID_ARGUMENT by the servicer) before anything reaches the engine.

What is checked before the prompt is tokenized (`validate_prompt_text`, `validate_chat`) is
cheap and bounds the tokenizer's work; the rest (`validate_prompt`, `validate_sampling`) runs
on the token ids. Lists and strings are measured before they are walked (`validate_sizes`),
and JSON the client sent as text is refused past `MAX_JSON_DEPTH` levels before anything
recurses over it: gRPC's limit on a message's size is not the only bound on either.
"""

import json
import math
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler_svc.config import REQUEST_OVERHEAD_BYTES
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.structured_output import StructuredOutput
from scheduler_svc.frontend.tokenizer import ChatMessage
from services.wire import (
    MAX_CACHE_SALT_BYTES,
    MAX_ID_LEN,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
)

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256                # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024         # with the EOS ids, within the wire's MAX_MIN_TOKENS_IDS
MAX_JSON_DEPTH = 128              # levels of arrays and objects in tools, documents, calls
# Below this a temperature is greedy: logits / 1e-45 overflow to inf and softmax gives NaN.
# The same floor as vLLM's; the worker's sampler applies it again.
MIN_TEMPERATURE = 1e-5
MAX_SEED = (1 << 64) - 1          # SamplingParams.seed is a uint64
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_CHOICES = 64                  # SamplingParams.n
# A choice's request id is `<request_id>-<index>`, within the wire's id length.
MAX_CHOICE_SUFFIX = len(f"-{MAX_CHOICES - 1}")

# The default prompt byte limit (see `default_max_prompt_bytes`).
PROMPT_BYTES_MARGIN = 2                 # normalizers (NFC) may shrink text before it is split
MAX_DEFAULT_PROMPT_BYTES = 8 << 20      # long-context models: 64 bytes per token at 128k
MAX_TOKEN_ID_BYTES = 5                  # a uint32 varint


def default_max_prompt_bytes(max_model_len: int, max_token_bytes: int) -> int:
    """The default limit on a text prompt's (or a rendered chat's) UTF-8 bytes.

    A token stands for at most `max_token_bytes` bytes of text (the vocabulary's longest
    token), so a text of more than `max_model_len * max_token_bytes` bytes cannot fit the
    context and is refused before tokenizing it. The margin covers normalizers that shrink
    text first; the cap keeps long-context models' limit at what one request may cost."""
    return min(max_model_len * max_token_bytes * PROMPT_BYTES_MARGIN, MAX_DEFAULT_PROMPT_BYTES)


def max_request_bytes(max_prompt_bytes: int, max_model_len: int) -> int:
    """The largest request message worth reading: the prompt limit (text, chat, or a full
    context of token ids) plus the other fields. gRPC refuses larger ones unread."""
    return max(max_prompt_bytes, max_model_len * MAX_TOKEN_ID_BYTES) + REQUEST_OVERHEAD_BYTES


class InvalidRequest(ValueError):
    """The request is malformed; the message names the field and what was wrong."""


@dataclass(frozen=True, slots=True)
class Limits:
    model_name: str
    vocab_size: int
    max_model_len: int
    max_kv_tokens: int | None = None   # tokens one request may hold in the KV pool
    max_prompt_bytes: int | None = None  # UTF-8 bytes of a text prompt or rendered chat
    # --seed's stream of the seeds unseeded random requests get (None: unpredictable ones).
    seeds: random.Random | None = None


def seed_stream(seed: int | None, frontend: int) -> random.Random | None:
    """Front end `frontend`'s stream of default seeds under --seed `seed` (each front end
    its own, so that the same requests to it get the same seeds in every run)."""
    return None if seed is None else random.Random(f"{seed}/{frontend}")


@dataclass(slots=True)
class RawSampling:
    """Sampling fields as the client sent them; None = not set."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    logprobs: int | None = None
    keep_special_tokens: bool = False
    structured_output: StructuredOutput | None = None   # checked by the servicer already
    n: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None


def validate_model(model: str, limits: Limits) -> None:
    if model and model != limits.model_name:
        shown = model if len(model) <= 256 else f"{model[:256]}... ({len(model)} characters)"
        raise InvalidRequest(f"unknown model {shown!r}; this server serves "
                             f"{limits.model_name!r}")


def validate_request_id(request_id: str) -> None:
    if len(request_id) > MAX_ID_LEN:
        raise InvalidRequest(f"request_id longer than {MAX_ID_LEN} characters")


def validate_cache_salt(cache_salt: str) -> bytes:
    """The salt as the bytes hashed into the request's first block; empty = unsalted."""
    salt = cache_salt.encode("utf-8", "surrogatepass")
    if len(salt) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequest(f"cache_salt is {len(salt)} bytes of UTF-8; at most "
                             f"{MAX_CACHE_SALT_BYTES} are allowed")
    return salt


def validate_prompt_text(text: str, limits: Limits, what: str = "prompt text") -> None:
    """Refuse a text too long to fit the context before spending time tokenizing it."""
    limit = limits.max_prompt_bytes
    if limit is None:
        return
    num_bytes = len(text.encode("utf-8", "surrogatepass"))
    if num_bytes > limit:
        raise InvalidRequest(
            f"{what} is {num_bytes} bytes of UTF-8; this server takes at most {limit} bytes "
            f"(the model's context is {limits.max_model_len} tokens)")


def parse_json_objects(text: str, what: str, max_bytes: int | None = None,
                       ) -> list[dict[str, Any]] | None:
    """A JSON array of objects (tools, documents, tool calls) as the client sent it; "" =
    not given. Its size is checked before it is parsed."""
    if not text:
        return None
    if max_bytes is not None and len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise InvalidRequest(f"{what} is longer than the {max_bytes} bytes a prompt may take")
    try:
        value = json.loads(text)
    except RecursionError:        # json's own recursion bound, some 1,000 levels
        raise InvalidRequest(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidRequest(f"{what} must be a JSON array of objects")
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def json_depth(value: Any) -> int:
    """Levels of lists and dicts in a parsed JSON value, walked without recursion (the
    template renderer and json.dumps, which come later, recurse)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in item)
    return deepest


def validate_chat(messages: Sequence[ChatMessage], limits: Limits,
                  tools: list[dict[str, Any]] | None = None,
                  documents: list[dict[str, Any]] | None = None) -> None:
    """Roles and sizes, before the chat template renders the messages.

    Roles are a closed set: the template writes a role verbatim between control tokens, so
    a role carrying template markup would become real control tokens. Content is not
    escaped: like HF transformers and vLLM, special-token text inside it (say
    "<|im_start|>") is tokenized as that special token; callers embedding untrusted text must
    strip it themselves."""
    if not messages:
        raise InvalidRequest("chat has no messages")
    if len(messages) > limits.max_model_len:
        raise InvalidRequest(f"chat has {len(messages)} messages; the model's context is "
                             f"{limits.max_model_len} tokens")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(f"chat message {i} has role {message.role[:64]!r}; roles are "
                                 f"{', '.join(CHAT_ROLES)}")
    extras = [json.dumps(x) for x in (tools, documents) if x is not None]
    extras += [json.dumps(m.tool_calls) for m in messages if m.tool_calls is not None]
    extras += [m.name or "" for m in messages] + [m.tool_call_id or "" for m in messages]
    validate_prompt_text("".join(m.content for m in messages) + "".join(extras), limits,
                         "chat content")


def validate_prompt(token_ids: Sequence[int], limits: Limits) -> None:
    if not token_ids:
        raise InvalidRequest("prompt is empty")
    # Length before the vocabulary scan: a huge list is refused without walking it.
    if len(token_ids) >= limits.max_model_len:
        raise InvalidRequest(
            f"prompt has {len(token_ids)} tokens; the model's context is {limits.max_model_len} "
            "tokens and at least one must be left to generate")
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})")


def validate_sizes(raw: RawSampling) -> None:
    """The lengths of the sampling's lists and strings, each refused by the field's name
    before any of them is walked."""
    if len(raw.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop has {len(raw.stop)} strings; at most {MAX_STOP_STRINGS} "
                             "are allowed")
    long = next((i for i, s in enumerate(raw.stop) if len(s) > MAX_STOP_LEN), None)
    if long is not None:
        raise InvalidRequest(f"stop[{long}] is {len(raw.stop[long])} characters long; at most "
                             f"{MAX_STOP_LEN} are allowed")
    if len(raw.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids has {len(raw.stop_token_ids)} ids; at most "
                             f"{MAX_STOP_TOKEN_IDS} are allowed")
    if len(raw.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias has {len(raw.logit_bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS} are allowed")


def validate_sampling(raw: RawSampling, num_prompt_tokens: int,
                      limits: Limits) -> SamplingParams:
    validate_sizes(raw)
    room = limits.max_model_len - num_prompt_tokens
    temperature = 1.0 if raw.temperature is None else raw.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {temperature}")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = 1.0 if raw.top_p is None else raw.top_p
    if not (0 < top_p <= 1):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    top_k = -1 if raw.top_k is None else raw.top_k
    if top_k < -1:
        raise InvalidRequest(f"top_k must be -1 (off), 0 (off) or >= 1, got {top_k}")
    if raw.max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    elif raw.max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be >= 1, got {raw.max_tokens}")
    elif raw.max_tokens > room:
        raise InvalidRequest(
            f"max_tokens {raw.max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds "
            f"the model's context of {limits.max_model_len} tokens")
    else:
        max_tokens = raw.max_tokens
    min_tokens = raw.min_tokens or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens must be in [0, max_tokens={max_tokens}], "
                             f"got {min_tokens}")
    if limits.max_kv_tokens is not None and num_prompt_tokens + max_tokens > limits.max_kv_tokens:
        raise InvalidRequest(
            f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) needs more KV cache than "
            f"a replica has ({limits.max_kv_tokens} tokens)")
    if any(not s for s in raw.stop):
        raise InvalidRequest("stop strings must not be empty")
    bad = next((t for t in raw.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"stop token id {bad} is outside the vocabulary")
    if raw.logprobs is not None and not 0 <= raw.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {raw.logprobs}")
    if raw.prompt_logprobs is not None and not 0 <= raw.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{raw.prompt_logprobs}")
    if raw.seed is not None and not 0 <= raw.seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be in [0, 2**64 - 1], got {raw.seed}")
    # Every random request gets a seed: the TP ranks of a replica each sample from the same
    # logits and must draw the same token, and a preempted request resumes identically.
    seed = raw.seed
    if seed is None and temperature > 0:
        seed = secrets.randbits(64) if limits.seeds is None else limits.seeds.getrandbits(64)
    n = 1 if raw.n is None else raw.n
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}], got {n}")
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        max_tokens=max_tokens, min_tokens=min_tokens, stop=raw.stop,
        include_stop_str_in_output=bool(raw.include_stop_str_in_output),
        stop_token_ids=raw.stop_token_ids, ignore_eos=bool(raw.ignore_eos),
        logprobs=raw.logprobs, skip_special_tokens=not raw.keep_special_tokens, n=n,
        prompt_logprobs=raw.prompt_logprobs, structured_output=raw.structured_output,
        **_penalties(raw, limits))


def _in_range(name: str, value: float | None, default: float, low: float, high: float,
              low_open: bool = False) -> float:
    if value is None:
        return default
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        raise InvalidRequest(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], "
                             f"got {value}")
    return value


def _penalties(raw: RawSampling, limits: Limits) -> dict[str, object]:
    """min_p, the penalties and logit_bias, checked against the bounds the worker's wire
    type declares (services.wire.SamplingSpec)."""
    if len(raw.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias has {len(raw.logit_bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS} are allowed")
    for token_id, bias in raw.logit_bias:
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidRequest(f"logit_bias token id {token_id} is outside the vocabulary "
                                 f"(0..{limits.vocab_size - 1})")
        _in_range(f"logit_bias[{token_id}]", bias, 0.0, -MAX_LOGIT_BIAS_VALUE,
                  MAX_LOGIT_BIAS_VALUE)
    if len({token_id for token_id, _ in raw.logit_bias}) != len(raw.logit_bias):
        raise InvalidRequest("logit_bias names a token id twice")
    return {
        "min_p": _in_range("min_p", raw.min_p, 0.0, 0.0, 1.0),
        "presence_penalty": _in_range("presence_penalty", raw.presence_penalty, 0.0, -2.0, 2.0),
        "frequency_penalty": _in_range("frequency_penalty", raw.frequency_penalty, 0.0,
                                       -2.0, 2.0),
        "repetition_penalty": _in_range("repetition_penalty", raw.repetition_penalty, 1.0,
                                        0.0, MAX_REPETITION_PENALTY, low_open=True),
        "logit_bias": tuple(raw.logit_bias),
    }
