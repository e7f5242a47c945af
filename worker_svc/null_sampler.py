"""What the null model samples (worker_svc.null_runner): deterministic tokens that decode like
text and are never EOS, except where a share of requests is told to end at a chosen step.

The rules, the same in every process and run, so that a test or a benchmark can predict every
token a request gets:

- output token i of a request is its prompt token at i mod the prompt's length, or the first
  prompt token after that (cyclically) that is not EOS (`echo_token`);
- with an EOS step K > 0, the requests a stable hash of their client's id puts in the EOS
  share (`ends_early`) sample EOS as their K-th output token (1-based), so that finishes
  happen, unless their min_tokens is K or more (then they echo on; stop token ids the echo
  rule may pick are not held back: the null model keeps no logits);
- a token mask (structured output) takes over: its first allowed token, so that the output
  keeps to the grammar and a completed grammar, which allows only its stop tokens, ends the
  request (one that never completes runs to max_tokens, as any request may);
- sampling parameters are honoured only as far as the scheduler needs: greedy and random
  sampling both get the rule's token; asked-for logprobs and prompt logprobs come back
  plausible (the token at logprob 0.0, then distinct alternatives far below it).

`NullSampler` is called by `NullRunner` at launch, once per step, on the rows that sample.
"""

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from services.wire import PromptLogprobs, TokenLogprobs, TokenMask
from worker_svc.input_batch import RequestState, ScheduledRequest
from worker_svc.token_mask import BITS_PER_WORD, mask_rows

# An alternative's logprob below the sampled token's 0.0: about 1e-13, each next one lower.
ALTERNATIVE_LOGPROB = -30.0
# What the scheduler's front ends append to the client's request id (`client_request_id`).
ENGINE_ID_SUFFIX = re.compile(r"#[0-9a-f]+\.[0-9a-f]+$")


def ends_early(request_id: str, eos_share: float) -> bool:
    """Whether `request_id` is in the share of requests that sample EOS at the EOS step: a
    stable 64-bit hash of the client's id (`client_request_id`) below `eos_share` of its
    range (share 1.0: every request)."""
    digest = hashlib.blake2b(client_request_id(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < eos_share * 2.0 ** 64


def client_request_id(request_id: str) -> str:
    """The client's id within a step's request id: the scheduler's front ends append
    "#<front end>.<handle>" (hex) to it, which no client can predict
    (scheduler_svc.engine.wire.engine_request_id); without that suffix, the id itself."""
    return ENGINE_ID_SUFFIX.sub("", request_id)


def echo_token(prompt_ids: Sequence[int], output_index: int, eos_ids: frozenset[int],
               fallback: int, num_prompt_tokens: int | None = None) -> int:
    """Output token `output_index` (0-based) of a request whose prompt is the first
    `num_prompt_tokens` of `prompt_ids` (None: all of them): the prompt token at
    output_index mod its length, skipping EOS ids forward (cyclically); `fallback` for a
    prompt of nothing but EOS ids."""
    if num_prompt_tokens is None:
        num_prompt_tokens = len(prompt_ids)
    for k in range(num_prompt_tokens):
        token_id = prompt_ids[(output_index + k) % num_prompt_tokens]
        if token_id not in eos_ids:
            return token_id
    return fallback


def first_allowed(bitmask: bytes) -> int:
    """The lowest token id a packed token mask (services.wire.TokenMask) allows."""
    words = np.frombuffer(bitmask, dtype="<u4")
    nonzero = np.flatnonzero(words)
    if not nonzero.size:
        raise ValueError("a token mask allows no token")
    word = int(words[nonzero[0]])
    return int(nonzero[0]) * BITS_PER_WORD + (word & -word).bit_length() - 1


def plausible_logprobs(token_id: int, num_top: int, vocab_size: int) -> TokenLogprobs:
    """`token_id` at probability 1 and `num_top` distinct alternatives (itself first, as a
    top-n list holds the argmax, then the ids after it), each far less likely."""
    ids = [(token_id + k) % vocab_size for k in range(min(num_top, vocab_size))]
    return TokenLogprobs(logprob=0.0, top_token_ids=ids,
                         top_logprobs=[0.0 if k == 0 else ALTERNATIVE_LOGPROB - k
                                       for k in range(len(ids))])


class NullSampler:
    """The token rules above for one model's vocabulary and EOS ids."""

    __slots__ = ("eos_ids", "vocab_size", "eos_step", "eos_share", "_eos_token", "_fallback")

    def __init__(self, eos_token_ids: Sequence[int], vocab_size: int, eos_step: int,
                 eos_share: float) -> None:
        """`eos_step`: K, the output token (1-based) the EOS share samples EOS as; 0: none."""
        self.eos_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.eos_step = eos_step
        self.eos_share = eos_share
        if eos_step and not eos_token_ids:
            raise ValueError("--null-eos-step needs a model with an EOS token id")
        self._eos_token = eos_token_ids[0] if eos_token_ids else 0
        # A prompt of nothing but EOS ids still gets a token that is none of them.
        self._fallback = next(t for t in range(vocab_size) if t not in self.eos_ids)

    def token(self, state: RequestState) -> int:
        """The request's next output token by the rules (its token ids hold every token
        sampled so far, placeholders of tokens still pending included)."""
        output_index = len(state.token_ids) - state.num_prompt_tokens
        if (self.eos_step and output_index == self.eos_step - 1
                and output_index >= state.sampling.min_tokens   # min_tokens holds EOS back
                and ends_early(state.request_id, self.eos_share)):
            return self._eos_token
        return echo_token(state.token_ids, output_index, self.eos_ids, self._fallback,
                          state.num_prompt_tokens)

    def sample(self, sampling: Sequence[ScheduledRequest], masks: Sequence[TokenMask]
               ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Tokens and logprobs (None where not asked) of the rows that sample, in order. Masks
        are checked as worker_svc.token_mask checks them (ValueError fails the step)."""
        eos_ids, eos_step = self.eos_ids, self.eos_step
        token_ids = []
        for s in sampling:
            state = s.state
            ids, num_prompt = state.token_ids, state.num_prompt_tokens
            # The common case of `token` inline (this loop is the null model's whole step).
            token_id = ids[(len(ids) - num_prompt) % num_prompt]
            if eos_step or token_id in eos_ids:
                token_id = self.token(state)
            token_ids.append(token_id)
        if masks:
            rows = mask_rows(masks, [s.state.request_id for s in sampling], self.vocab_size)
            for row, mask in zip(rows, masks, strict=True):
                token_ids[row] = first_allowed(mask.bitmask)
        if all(s.state.plain_greedy for s in sampling):
            return token_ids, [None] * len(token_ids)
        logprobs: list[TokenLogprobs | None] = [
            None if (n := s.state.sampling.num_logprobs) is None
            else plausible_logprobs(t, n, self.vocab_size)
            for s, t in zip(sampling, token_ids, strict=True)]
        return token_ids, logprobs

    def prompt_logprobs(self, layout: Sequence[ScheduledRequest]) -> list[PromptLogprobs]:
        """Prompt logprobs for the requests that asked, over the prompt positions this step
        computes (worker_svc.prompt_logprobs's span): each prompt token certain, rank 1."""
        results = []
        for s in layout:
            num_top = s.state.sampling.num_prompt_logprobs
            start = s.num_computed_tokens
            end = min(start + s.num_new_tokens, s.state.num_prompt_tokens - 1)
            if num_top is None or end <= start:
                continue
            targets = s.state.token_ids[start + 1:end + 1]
            results.append(PromptLogprobs(
                s.state.request_id, start + 1,
                [plausible_logprobs(t, num_top, self.vocab_size) for t in targets],
                [1] * len(targets)))
        return results
