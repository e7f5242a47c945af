"""The OpenAI response objects, built from the scheduler's chunks: choices, usage, finish and
stop reasons, and the two logprobs shapes.

Logprobs follow vLLM's OpenAI server. A token's text is its id decoded on its own (half a
UTF-8 character decodes to U+FFFD). Each position's candidates are the sampled token first,
then the engine's best alternatives (a duplicate of the sampled one dropped), logprobs floored
at -9999.0.
- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where
  `top_logprobs` holds per position a dict text -> logprob of the first `logprobs` + 1
  candidates (OpenAI's "the most likely tokens, plus the sampled one"), and `text_offset` is
  each token's character offset, running from the text already returned.
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`, with the first
  `top_logprobs` candidates in `top_logprobs` and `bytes` the token text's UTF-8.
- prompt logprobs, vLLM's shape: per prompt token, None for the first, then a dict token id
  -> {"logprob", "rank", "decoded_token"} of the prompt token and the `prompt_logprobs` best.
  With completions' `echo` and `logprobs`, the prompt's tokens lead the completions shape,
  the first with null logprobs.

`collect` reads one call's choices; `collect_all` reads a batch's calls, a bounded number open
at once.
"""

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from http_svc.errors import ApiError
from http_svc.sampling import Sampling
from http_svc.scheduler_client import (
    Chunk,
    GenerateSpec,
    GenerationCall,
    TokenLogprob,
    Usage,
)

MIN_LOGPROB = -9999.0   # what -inf becomes: JSON has no infinity
# Scheduler calls one non-streamed request keeps open at once; its other prompts wait their
# turn. Thousands at once overflow the backlog of calls the scheduler's gRPC server has taken
# but not yet handed to its servicer, and gRPC cancels calls past that backlog
# (`grpc.server.max_pending_requests`), another client's as well as ours.
MAX_CALLS_IN_FLIGHT = 16


def candidates(lp: TokenLogprob) -> list[tuple[int, float]]:
    """The sampled token, then the alternatives, each id once."""
    found = {lp.token_id: lp.logprob}
    for token_id, logprob in lp.top:
        found.setdefault(token_id, logprob)
    return list(found.items())


def completion_logprobs(vocab: Sequence[str], logprobs: Sequence[TokenLogprob], num_top: int,
                        initial_text_offset: int = 0) -> dict[str, Any]:
    tokens = [vocab[lp.token_id] for lp in logprobs]
    offsets: list[int] = []
    offset = initial_text_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "text_offset": offsets,
        "token_logprobs": [max(lp.logprob, MIN_LOGPROB) for lp in logprobs],
        "tokens": tokens,
        "top_logprobs": [{vocab[t]: max(v, MIN_LOGPROB) for t, v in candidates(lp)[:num_top + 1]}
                         for lp in logprobs],
    }


def prompt_logprobs_body(vocab: Sequence[str], logprobs: Sequence[TokenLogprob],
                         num_top: int) -> list[dict[str, Any] | None]:
    body: list[dict[str, Any] | None] = [None]
    for lp in logprobs:
        entry = {str(lp.token_id): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank,
                                    "decoded_token": vocab[lp.token_id]}}
        for rank, (token_id, logprob) in enumerate(lp.top[:num_top], start=1):
            entry.setdefault(str(token_id), {"logprob": max(logprob, MIN_LOGPROB),
                                             "rank": rank, "decoded_token": vocab[token_id]})
        body.append(entry)
    return body


def echo_logprobs(vocab: Sequence[str], first_token_id: int, logprobs: Sequence[TokenLogprob],
                  num_top: int, generated: dict[str, Any] | None) -> dict[str, Any]:
    """The completions shape over the prompt's tokens (the first with null logprobs), then
    `generated`'s (a completions shape whose text_offset starts after the prompt's text)."""
    tokens = [vocab[first_token_id]] + [vocab[lp.token_id] for lp in logprobs]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    body: dict[str, Any] = {
        "text_offset": offsets, "tokens": tokens,
        "token_logprobs": [None] + [max(lp.logprob, MIN_LOGPROB) for lp in logprobs],
        "top_logprobs": [None] + [{vocab[t]: max(v, MIN_LOGPROB)
                                   for t, v in candidates(lp)[:num_top + 1]}
                                  for lp in logprobs]}
    if generated is not None:
        for key in body:
            body[key] += generated[key]
    return body


def _chat_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": max(logprob, MIN_LOGPROB),
            "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(vocab: Sequence[str], logprobs: Sequence[TokenLogprob],
                  num_top: int) -> dict[str, Any]:
    return {"content": [
        {**_chat_logprob(vocab[lp.token_id], lp.logprob),
         "top_logprobs": [_chat_logprob(vocab[t], v) for t, v in candidates(lp)[:num_top]]}
        for lp in logprobs]}


def stop_reason(chunk: Chunk, sampling: Sampling) -> str | int | None:
    """vLLM's stop_reason: the stop string (a str) or stop token id (an int) that ended the
    output; None for EOS and the length limit. The gRPC API sends either as text."""
    reason = chunk.stop_reason
    if reason is None or reason in sampling.stop:
        return reason
    if reason.isdigit() and int(reason) in sampling.stop_token_ids:
        return int(reason)
    return reason


def usage_body(usages: Sequence[Usage], n: int = 1) -> dict[str, Any]:
    """`usages` by choice index, `n` choices per prompt: each prompt counts once (its first
    choice's prompt and cached tokens, as vLLM reports them), every choice's output counts."""
    firsts = usages[::n]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens
                                                           for u in firsts)}}


@dataclass(slots=True)
class Collected:
    """One choice's chunks gathered into what a non-streamed response reports."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.prompt_logprobs = self.prompt_logprobs or chunk.prompt_logprobs
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.last = chunk

    @property
    def usage(self) -> Usage:
        assert self.last is not None and self.last.usage is not None, "stream ended early"
        return self.last.usage


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      chunk: Chunk, sampling: Sampling) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": chunk.finish_reason, "stop_reason": stop_reason(chunk, sampling)}


def chat_choice(index: int, role: str, text: str, logprobs: dict[str, Any] | None,
                chunk: Chunk, sampling: Sampling, message: dict[str, Any] | None = None,
                finish_reason: str | None = None) -> dict[str, Any]:
    """`message`: the reply read into its fields (http_svc.replies), instead of `text`;
    `finish_reason`: instead of the chunk's ("tool_calls" where the reply made calls)."""
    return {"index": index, "message": message or {"role": role, "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason or chunk.finish_reason,
            "stop_reason": stop_reason(chunk, sampling)}


def chat_delta(index: int, delta: str | dict[str, Any], logprobs: dict[str, Any] | None,
               chunk: Chunk, sampling: Sampling,
               finish_reason: str | None = None) -> dict[str, Any]:
    """A streamed chat choice after the first (which carries only the role): `delta` is the
    content text, or the delta's fields (content, reasoning_content, tool_calls)."""
    fields = {"content": delta} if isinstance(delta, str) else delta or {"content": ""}
    return {"index": index, "delta": fields, "logprobs": logprobs,
            "finish_reason": finish_reason or chunk.finish_reason,
            "stop_reason": stop_reason(chunk, sampling)}


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """vLLM's continuous usage stats: one choice's tokens so far, on each streamed chunk."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def collect(call: GenerationCall, n: int = 1) -> list[Collected]:
    """Each of the call's `n` choices, gathered."""
    collected = [Collected() for _ in range(n)]
    async for chunk in call:
        if chunk.index >= n:
            raise ApiError(500, f"the scheduler sent choice {chunk.index} of {n}")
        collected[chunk.index].add(chunk)
    if any(c.last is None or c.last.finish_reason is None for c in collected):
        raise ApiError(500, "the scheduler ended the stream without a finish reason")
    return collected


async def collect_all(generate: Callable[[GenerateSpec, bool], GenerationCall],
                      specs: Sequence[GenerateSpec], whole: bool, n: int,
                      ) -> list[list[Collected]]:
    """Each spec's `n` choices, in the specs' order, with at most MAX_CALLS_IN_FLIGHT calls
    open at once (`generate(spec, whole)` opens one). Every call is closed once read; on any
    failure, or when the caller is cancelled, the open ones are cancelled and no more start."""
    results: list[list[Collected]] = [[] for _ in specs]
    pending = iter(enumerate(specs))

    async def run_some() -> None:
        for i, spec in pending:
            call = generate(spec, whole)
            try:
                results[i] = await collect(call, n)
            finally:
                call.cancel()

    runners = [asyncio.ensure_future(run_some())
               for _ in range(min(MAX_CALLS_IN_FLIGHT, len(specs)))]
    try:
        await asyncio.gather(*runners)
    finally:
        for runner in runners:
            runner.cancel()
    return results
