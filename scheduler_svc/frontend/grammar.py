"""Structured output's grammars, with xgrammar: compiled once per constraint (cached) against
the front end's tokenizer, and sent to the engine cores as xgrammar's serialized JSON.

The front end compiles a request's constraint (`Grammars.compile_async`: within the request's
budget, `--max-grammar-compile-s`, waited for on the compile pool's own threads,
scheduler_svc.frontend.grammar_pool, and run in a child of the front end's compile server,
scheduler_svc.frontend.compile_server, killed when the budget runs out; never on the event
loop, which serves every client, nor on the tokenizer threads, which every prompt needs) and
sends the compiled grammar with the request
(`EngineRequest.grammar`), after the vocabulary (`vocabulary`, once per engine core). A request
reaches an engine core only once its grammar is compiled, so one waiting for it holds no batch
slot. The engine core keeps each request's place in its grammar
(scheduler_svc.engine.grammar): for each step that samples a token for the request it packs
the allowed tokens into the step's token masks (the worker masks the logits with them,
worker_svc.token_mask), and advances with the token that comes back; a grammar that is
complete finishes the request.

Vocabulary: the tokenizer's ids, padded to the model's logits width (`vocab_size`), whose
extra ids xgrammar never allows. The model's EOS ids are the grammar's stop tokens.
"""

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from scheduler_svc.frontend.compile_process import (
    CompileFailed,
    CompileProcess,
    CompileServerLost,
)
from scheduler_svc.frontend.grammar_pool import DEFAULT_MAX_COMPILE_S, GrammarPool
from scheduler_svc.frontend.structured_output import (
    FIELD,
    OutputKind,
    StructuredOutput,
    StructuredOutputError,
)
from scheduler_svc.frontend.tokenizer import TextTokenizer


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A constraint compiled against this front end's tokenizer, serialized for the engine."""

    spec: StructuredOutput
    serialized: bytes              # xgrammar's CompiledGrammar.serialize_json(), UTF-8


log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512          # compiled grammars kept, least recently used dropped


class Grammars:
    """Compiles constraints into grammars for one tokenizer; thread-safe."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int,
                 eos_token_ids: tuple[int, ...],
                 max_compile_s: float = DEFAULT_MAX_COMPILE_S) -> None:
        """`vocab_size`: the model's logits width, the length of every mask.
        `max_compile_s`: a request's compile budget (--max-grammar-compile-s)."""
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        # Started on first use (~2 s: it imports xgrammar, which brings torch).
        self._process: CompileProcess | None = None
        self._vocabulary = b""                  # its TokenizerInfo, serialized (engine cores)
        self._process_lock = threading.Lock()   # held while it starts (off the loop)
        self._lock = threading.Lock()            # the cache's; never held while compiling
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self.num_compiled = 0                    # constraints compiled (cache misses)
        self.pool: GrammarPool[StructuredOutput, CompiledGrammar] = GrammarPool(
            self.compile, self._cancel, max_compile_s)

    def close(self) -> None:
        self.pool.close()
        if self._process is not None:
            self._process.close()

    @property
    def process(self) -> CompileProcess | None:
        """The compile server's client, once started."""
        return self._process

    async def compile_async(self, spec: StructuredOutput) -> CompiledGrammar:
        """The grammar of `spec`: from the cache, or compiled on the compile pool within the
        budget. Raises StructuredOutputError naming the field (CompileTimeout past the
        budget)."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        if not self._vocabulary:
            # Started once (importing xgrammar, reading the vocabulary: seconds), outside any
            # request's budget and off the loop.
            await asyncio.to_thread(self._get_process)
        return await self.pool.compile(spec, f"{FIELD}.{spec.kind.value}")

    def _get_process(self) -> CompileProcess:
        if self._tokenizer.vocab_size > self.vocab_size:
            # A mask can only cover the logits; such a model's tokens past them cannot be
            # told apart from the grammar's.
            raise StructuredOutputError(
                f"{FIELD} is not served for this model: its tokenizer has "
                f"{self._tokenizer.vocab_size} ids, its logits {self.vocab_size}")
        with self._process_lock:
            if self._process is None:
                self._process = CompileProcess(self._tokenizer.tokenizer.to_str(),
                                               self.vocab_size, self._eos_token_ids)
            process = self._process
        try:
            vocabulary = process.vocabulary()
        except CompileServerLost as exc:
            raise StructuredOutputError(f"{FIELD} is not served here: {exc}") from None
        self._vocabulary = vocabulary
        return process

    def vocabulary(self) -> bytes:
        """The tokenizer's vocabulary as the engine cores' grammars need it (a compiled
        grammar came first, so it is known)."""
        return self._vocabulary

    def cached(self, spec: StructuredOutput) -> CompiledGrammar | None:
        """The compiled grammar if it is cached (no compiling: safe on the event loop)."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
            return grammar

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The grammar of `spec`, compiled in a child of the compile server; raises
        StructuredOutputError naming the field when xgrammar cannot compile it (an
        unsupported schema keyword, a malformed regex or grammar), CompileCancelled when
        `_cancel` killed it, CompileServerLost when the server died under it."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        process = self._get_process()
        start = time.monotonic()
        if spec.kind is OutputKind.JSON_SCHEMA:
            kind, text = "json_schema", spec.text
        elif spec.kind is OutputKind.JSON_OBJECT:
            # A JSON object, as OpenAI's json_object means (the builtin JSON grammar takes
            # any JSON value, arrays and numbers too).
            kind, text = "json_schema", '{"type": "object"}'
        elif spec.kind is OutputKind.REGEX:
            kind, text = "regex", spec.text
        elif spec.kind is OutputKind.GRAMMAR:
            kind, text = "grammar", spec.text       # EBNF, from rule `root`
        else:
            kind, text = "grammar", choice_grammar(spec.choices)
        try:
            serialized = process.compile(spec, kind, text)
        except CompileFailed as exc:
            raise StructuredOutputError(
                f"{FIELD}.{spec.kind.value} does not compile: {exc}") from None
        grammar = CompiledGrammar(spec, serialized)
        log.info("compiled a %s grammar (%d bytes of constraint) in %.3f s", spec.kind.value,
                 len(spec.text) + sum(len(c) for c in spec.choices), time.monotonic() - start)
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = grammar
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def _cancel(self, spec: StructuredOutput) -> None:
        if self._process is not None:
            self._process.cancel(spec)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string escapes are
    xgrammar's EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
