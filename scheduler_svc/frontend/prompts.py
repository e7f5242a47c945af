"""A front end's prompts: rendered (chat templates) and tokenized, and token ids decoded back
to text, on a small thread pool beside the event loop (HF tokenizers release the GIL while
encoding, so these run beside the loop rather than taking turns with it); structured
output's grammars compile on their own pool within a budget (scheduler_svc.frontend.
grammar_pool), never on these threads. Sizes and roles are checked on the loop first, so no
thread is handed more than `Limits.max_prompt_bytes` bytes.

Owned by the front end's core (scheduler_svc.frontend.core: `Frontend.prompts`), whose
`prepare` makes a `PreparedRequest` from a client's `PromptInput` and settings.
"""

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from scheduler_svc.frontend.grammar import CompiledGrammar, Grammars
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.structured_output import StructuredOutput, StructuredOutputError
from scheduler_svc.frontend.tokenizer import ChatMessage, TemplateError, TextTokenizer
from scheduler_svc.frontend.validation import (
    InvalidRequest,
    Limits,
    validate_chat,
    validate_prompt,
    validate_prompt_text,
)

# Prompts tokenized at once; more wait for a thread.
TOKENIZER_THREADS = 2


@dataclass(frozen=True, slots=True)
class PromptInput:
    """Exactly one of the three is set."""

    text: str | None = None
    token_ids: Sequence[int] | None = None    # copied to a list once its length is checked
    chat: list[ChatMessage] | None = None
    # With chat only: the template's `tools` and `documents` (JSON objects), None = not given.
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None   # more template variables (chat only)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: bytes = b""     # the tenant's prefix-cache salt, UTF-8; empty = unsalted
    grammar: CompiledGrammar | None = None   # sampling.structured_output, compiled


class Prompts:
    """Tokenizing, detokenizing and grammar compiling for one front end."""

    def __init__(self, tokenizer: TextTokenizer, limits: Limits, grammars: Grammars | None,
                 threads: int = TOKENIZER_THREADS) -> None:
        """`grammars`: structured output's compiler (None: such requests are refused)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammars = grammars
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def render(self, prompt: PromptInput,
                     add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """The prompt text and its token ids (token-id input has no text). Sizes and roles are
        checked here on the loop; rendering and tokenizing run on the tokenizer threads."""
        if prompt.token_ids is not None:
            validate_prompt(prompt.token_ids, self.limits)   # before copying a huge list
            return "", list(prompt.token_ids)
        if prompt.chat is not None:
            validate_chat(prompt.chat, self.limits, prompt.tools, prompt.documents)
        else:
            validate_prompt_text(prompt.text or "", self.limits)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._render_blocking, prompt,
                                          add_generation_prompt)

    def _render_blocking(self, prompt: PromptInput,
                         add_generation_prompt: bool) -> tuple[str, list[int]]:
        """On a tokenizer thread."""
        if prompt.chat is not None:
            try:
                text = self.tokenizer.render_chat(prompt.chat, add_generation_prompt,
                                                  prompt.tools, prompt.documents,
                                                  prompt.template_kwargs)
            except TemplateError as exc:
                raise InvalidRequest(str(exc)) from exc
            validate_prompt_text(text, self.limits, "rendered chat")
            return text, self.tokenizer.encode(text)
        text = prompt.text or ""
        # As vLLM's completions: with the special tokens the model's tokenizer adds (BOS).
        return text, self.tokenizer.encode(text, add_special_tokens=True)

    async def detokenize(self, sequences: Sequence[Sequence[int]],
                         skip_special_tokens: bool) -> list[str]:
        """Each sequence's text, decoded on its own, on the tokenizer threads (a vocabulary's
        worth of one-token sequences takes tens of milliseconds)."""
        vocab_size = self.limits.vocab_size
        for i, ids in enumerate(sequences):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"sequences[{i}]: token id {bad} is outside the "
                                     f"vocabulary (0..{vocab_size - 1})")
        lists = [list(ids) for ids in sequences]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, lambda: self.tokenizer.tokenizer.decode_batch(
                lists, skip_special_tokens=skip_special_tokens))

    async def compile_grammar(self, spec: StructuredOutput) -> CompiledGrammar:
        """The constraint's grammar: from the cache, or compiled on the grammars' own compile
        pool within the request's budget (never on the tokenizer threads every prompt needs)."""
        if self.grammars is None:
            raise InvalidRequest("structured_output is not served by this scheduler")
        try:
            return await self.grammars.compile_async(spec)
        except StructuredOutputError as exc:
            raise InvalidRequest(str(exc)) from None
