"""Request validation at the API edge: every bad input becomes one clear `InvalidRequest`
message (mapped to INVALID_ARGUMENT by the servicer) before anything reaches the engine."""

import math
import secrets
from dataclasses import dataclass

from scheduler_svc.request import SamplingParams
from services.wire import MAX_ID_LEN, MAX_TOP_LOGPROBS

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


class InvalidRequest(ValueError):
    """The request is malformed; the message names the field and what was wrong."""


@dataclass(frozen=True, slots=True)
class Limits:
    model_name: str
    vocab_size: int
    max_model_len: int
    max_kv_tokens: int | None = None   # tokens one request may hold in the KV pool


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
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    logprobs: int | None = None
    keep_special_tokens: bool = False


def validate_model(model: str, limits: Limits) -> None:
    if model and model != limits.model_name:
        raise InvalidRequest(f"unknown model {model!r}; this server serves {limits.model_name!r}")


def validate_request_id(request_id: str) -> None:
    if len(request_id) > MAX_ID_LEN:
        raise InvalidRequest(f"request_id longer than {MAX_ID_LEN} characters")


def validate_prompt(token_ids: list[int], limits: Limits) -> None:
    if not token_ids:
        raise InvalidRequest("prompt is empty")
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})")
    if len(token_ids) >= limits.max_model_len:
        raise InvalidRequest(
            f"prompt has {len(token_ids)} tokens; the model's context is {limits.max_model_len} "
            "tokens and at least one must be left to generate")


def validate_sampling(raw: RawSampling, num_prompt_tokens: int,
                      limits: Limits) -> SamplingParams:
    room = limits.max_model_len - num_prompt_tokens
    temperature = 1.0 if raw.temperature is None else raw.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {temperature}")
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
    if len(raw.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in raw.stop):
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings of at most "
                             f"{MAX_STOP_LEN} characters")
    if any(not s for s in raw.stop):
        raise InvalidRequest("stop strings must not be empty")
    bad = next((t for t in raw.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"stop token id {bad} is outside the vocabulary")
    if raw.logprobs is not None and not 0 <= raw.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {raw.logprobs}")
    # Every random request gets a seed: the TP ranks of a replica each sample from the same
    # logits and must draw the same token, and a preempted request resumes identically.
    seed = raw.seed
    if seed is None and temperature > 0:
        seed = secrets.randbits(63)
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        max_tokens=max_tokens, min_tokens=min_tokens, stop=raw.stop,
        stop_token_ids=raw.stop_token_ids, ignore_eos=bool(raw.ignore_eos),
        logprobs=raw.logprobs, skip_special_tokens=not raw.keep_special_tokens)
