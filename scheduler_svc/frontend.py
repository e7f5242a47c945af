"""The client-facing core: turns a prompt into token ids, validates, routes the request to a
replica and streams its outputs back. No protobuf here; `servicer.py` adapts it to gRPC.

Chat templates are rendered and text is tokenized on a small thread pool, never on the event
loop: that loop serves every client stream and the workers' registrations and heartbeats, and
a long prompt once held it for seconds (long enough for a replica to be declared lost). The
prompt's size is checked on the loop first, so no thread is handed more than
`Limits.max_prompt_bytes` bytes.
"""

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.grammar import CompiledGrammar, Grammars
from scheduler_svc.live_requests import DuplicateRequest
from scheduler_svc.metrics import RequestTimer, SchedulerMetrics
from scheduler_svc.request import Request, RequestOutput, SamplingParams, merge_outputs
from scheduler_svc.router import Router
from scheduler_svc.structured_output import StructuredOutput, StructuredOutputError
from scheduler_svc.tokenizer import ChatMessage, TemplateError, TextTokenizer
from scheduler_svc.validation import (
    InvalidRequest,
    Limits,
    RawSampling,
    validate_cache_salt,
    validate_chat,
    validate_model,
    validate_prompt,
    validate_prompt_text,
    validate_request_id,
    validate_sampling,
)

log = logging.getLogger(__name__)

# Prompts tokenized at once; more wait for a thread. HF tokenizers release the GIL while
# encoding, so these run beside the loop rather than taking turns with it.
TOKENIZER_THREADS = 2


class Draining(RuntimeError):
    """The server takes no new requests (draining): UNAVAILABLE."""


class QueueFull(RuntimeError):
    """Too many live requests (RESOURCE_EXHAUSTED)."""


class RequestFailed(RuntimeError):
    """The request ended without finishing; the message says why. UNAVAILABLE (its replica
    was lost and none came back in time), or INTERNAL where `server_fault` (a step failed)."""

    def __init__(self, message: str, server_fault: bool = False) -> None:
        super().__init__(message)
        self.server_fault = server_fault


@dataclass(frozen=True, slots=True)
class PromptInput:
    """Exactly one of the three is set."""

    text: str | None = None
    token_ids: Sequence[int] | None = None    # copied to a list once its length is checked
    chat: list[ChatMessage] | None = None
    # With chat only: the template's `tools` and `documents` (JSON objects), None = not given.
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: bytes = b""     # the tenant's prefix-cache salt, UTF-8; empty = unsalted
    grammar: CompiledGrammar | None = None   # sampling.structured_output, compiled


class LoopPoster:
    """Hands callbacks from engine threads to one asyncio loop, many per wake-up.

    A step finishes dozens of requests' outputs at once; one `call_soon_threadsafe` each
    would wake the loop (a pipe write, a GIL hand-over) dozens of times per step. Here the
    first post since the last drain schedules one drain and later ones only append."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[RequestOutput], None], RequestOutput]] = []

    def post(self, fn: Callable[[RequestOutput], None], arg: RequestOutput) -> None:
        with self._lock:
            self._pending.append((fn, arg))
            first = len(self._pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fn, arg in pending:
            fn(arg)


class OutputStream:
    """One request's outputs on their way from the engine thread to its client stream.

    Outputs that arrive while the stream is busy are sent together as one: a stream that fell
    behind (its event loop busy with many streams, or a slow client) sends one message for
    several steps instead of falling further behind. With `interval` > 1 the stream also waits
    for that many tokens before it wakes (as vLLM's --stream-interval): the first tokens and
    the end go out at once. With `interval` None it wakes only at the end: a client that takes
    the whole output at once (GenerateOnce) costs the event loop nothing per token. An error
    is never merged: the tokens before it go first."""

    def __init__(self, interval: int | None = 1) -> None:
        self.interval = interval
        self._waiting: list[RequestOutput] = []
        self._num_waiting_tokens = 0
        self._sent_tokens = False
        self._ready = asyncio.Event()
        self._held: RequestOutput | None = None

    def put(self, out: RequestOutput) -> None:
        self._waiting.append(out)
        self._num_waiting_tokens += len(out.new_token_ids)
        if (out.finish_reason is not None or out.error is not None
                or self.interval is not None and (self._num_waiting_tokens >= self.interval
                                                  or not self._sent_tokens)):
            self._ready.set()

    async def get(self) -> RequestOutput:
        if self._held is not None:
            out, self._held = self._held, None
            return out
        await self._ready.wait()
        self._ready.clear()
        ready, self._waiting, self._num_waiting_tokens = self._waiting, [], 0
        if len(ready) > 1 and ready[-1].error is not None:
            self._held = ready.pop()
        out = merge_outputs(ready)
        self._sent_tokens = self._sent_tokens or bool(out.new_token_ids)
        return out


class Frontend:
    def __init__(self, router: Router, tokenizer: TextTokenizer, limits: Limits,
                 max_live_requests: int, replica_wait_s: float = 60.0,
                 metrics: SchedulerMetrics | None = None,
                 tokenizer_threads: int = TOKENIZER_THREADS,
                 grammars: Grammars | None = None, stream_interval: int = 1) -> None:
        """`grammars`: structured output's compiler (None: such requests are refused).
        `stream_interval`: tokens per client stream message (OutputStream)."""
        self.router = router
        self.membership = router.membership
        self.live = router.live
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_live_requests = max_live_requests
        self.stream_interval = stream_interval      # tokens per stream message (OutputStream)
        # How long a request may wait for a ready replica (at start, or after its replica
        # was lost with no other left), unless the client's deadline comes first.
        self.replica_wait_s = replica_wait_s
        self._poster: LoopPoster | None = None      # for the loop serving the clients
        self._tokenize_pool = ThreadPoolExecutor(tokenizer_threads,
                                                 thread_name_prefix="tokenize")
        self.metrics = metrics
        self.grammars = grammars
        self.num_requests_total = 0
        self.draining = False

    @property
    def num_live(self) -> int:
        return len(self.live)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

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
        return await loop.run_in_executor(self._tokenize_pool, self._render_blocking, prompt,
                                          add_generation_prompt)

    def _render_blocking(self, prompt: PromptInput,
                         add_generation_prompt: bool) -> tuple[str, list[int]]:
        """On a tokenizer thread."""
        if prompt.chat is not None:
            try:
                text = self.tokenizer.render_chat(prompt.chat, add_generation_prompt,
                                                  prompt.tools, prompt.documents)
            except TemplateError as exc:
                raise InvalidRequest(str(exc)) from exc
            validate_prompt_text(text, self.limits, "rendered chat")
            return text, self.tokenizer.encode(text)
        text = prompt.text or ""
        return text, self.tokenizer.encode(text) if text else []

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
            self._tokenize_pool, lambda: self.tokenizer.tokenizer.decode_batch(
                lists, skip_special_tokens=skip_special_tokens))

    async def prepare(self, request_id: str, model: str, prompt: PromptInput,
                      raw: RawSampling, cache_salt: str = "") -> PreparedRequest:
        validate_model(model, self.limits)
        validate_request_id(request_id)
        salt = validate_cache_salt(cache_salt)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.live:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        _, token_ids = await self.render(prompt)
        # Again: another request may have taken the id while this one was tokenized.
        if request_id in self.live:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        limits = dataclasses.replace(self.limits, max_kv_tokens=self.membership.max_kv_tokens())
        validate_prompt(token_ids, limits)
        sampling = validate_sampling(raw, len(token_ids), limits)
        grammar = None
        if sampling.structured_output is not None:
            grammar = await self.compile_grammar(sampling.structured_output)
        return PreparedRequest(request_id, token_ids, sampling, salt, grammar)

    async def compile_grammar(self, spec: StructuredOutput) -> CompiledGrammar:
        """The constraint's grammar: from the cache, or compiled on a tokenizer thread (a
        large schema takes long enough to stall every other client on the loop)."""
        if self.grammars is None:
            raise InvalidRequest("structured_output is not served by this scheduler")
        grammars = self.grammars
        grammar = grammars.cached(spec)
        if grammar is not None:
            return grammar
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._tokenize_pool, grammars.compile, spec)
        except StructuredOutputError as exc:
            raise InvalidRequest(str(exc)) from None

    async def generate(self, prepared: PreparedRequest, time_remaining: float | None = None,
                       whole: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per step that produced tokens (`whole`: one for them all);
        the last one has a finish_reason. Aborts the request if the consumer stops early
        (client cancelled). `time_remaining`: seconds to the client's deadline, if it set one.
        Raises InvalidRequest if the replica refuses it (it can never run there)."""
        if self.draining:
            raise Draining("the server is draining; send new requests elsewhere")
        if len(self.live) >= self.max_live_requests:
            raise QueueFull(f"{len(self.live)} requests are live; try again later")
        loop = asyncio.get_running_loop()
        if self._poster is None or self._poster.loop is not loop:
            self._poster = LoopPoster(loop)
        poster = self._poster
        outputs = OutputStream(None if whole else self.stream_interval)

        def sink(out: RequestOutput) -> None:
            poster.post(outputs.put, out)

        wait_s = self.replica_wait_s
        if time_remaining is not None:   # end before the client's own deadline fires
            wait_s = min(wait_s, max(0.0, time_remaining - 0.5))
        request_id = prepared.request_id
        request = self.make_request(prepared, time.monotonic() + wait_s)
        try:
            self.live.add(request, sink)
        except DuplicateRequest as exc:
            raise InvalidRequest(str(exc)) from None
        self.num_requests_total += 1
        timer = RequestTimer(self.metrics)
        finished = False
        try:
            self.router.dispatch(request)
            while True:
                out = await outputs.get()
                if out.error is not None:
                    finished = True
                    timer.failed()
                    if out.invalid:         # refused by the replica it was dispatched to
                        raise InvalidRequest(out.error)
                    raise RequestFailed(out.error, out.server_fault)
                timer.tokens(len(out.new_token_ids))
                if out.finish_reason is not None:
                    finished = True
                    timer.finished(out.finish_reason.value, out.num_prompt_tokens)
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.live.cancel(request_id)
            self.live.remove(request_id)

    def make_request(self, prepared: PreparedRequest, deadline: float) -> Request:
        """The scheduler's state for a prepared request, with its detokenizer."""
        sc: SchedulerConfig = self.membership.sched_config
        request = Request(prepared.request_id, prepared.prompt_token_ids, prepared.sampling,
                          self.membership.model.eos_token_ids, sc.max_model_len, sc.block_size,
                          hash_blocks=sc.prefix_caching, cache_salt=prepared.cache_salt)
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, prepared.prompt_token_ids, prepared.sampling.skip_special_tokens,
            prepared.sampling.stop)
        request.deadline = deadline
        if prepared.grammar is not None and self.grammars is not None:
            request.grammar = self.grammars.new_state(prepared.grammar)
        return request
