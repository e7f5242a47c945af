"""The client-facing core: turns a prompt into token ids, validates, routes the request to a
replica and streams its outputs back. No protobuf here; `servicer.py` adapts it to gRPC.
"""

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from scheduler_svc.cluster import Cluster
from scheduler_svc.engine import ReplicaEngine
from scheduler_svc.request import RequestOutput, SamplingParams
from scheduler_svc.tokenizer import ChatMessage, TemplateError, TextTokenizer
from scheduler_svc.validation import (
    InvalidRequest,
    Limits,
    RawSampling,
    validate_model,
    validate_prompt,
    validate_request_id,
    validate_sampling,
)

log = logging.getLogger(__name__)


class NoReplica(RuntimeError):
    """No replica is ready to serve (UNAVAILABLE)."""


class QueueFull(RuntimeError):
    """Too many live requests (RESOURCE_EXHAUSTED)."""


class RequestFailed(RuntimeError):
    """The request ended without finishing; the message says why (UNAVAILABLE)."""


@dataclass(frozen=True, slots=True)
class PromptInput:
    """Exactly one of the three is set."""

    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[ChatMessage] | None = None


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class Frontend:
    def __init__(self, cluster: Cluster, tokenizer: TextTokenizer, limits: Limits,
                 max_live_requests: int) -> None:
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_live_requests = max_live_requests
        self._live: dict[str, ReplicaEngine] = {}
        self.num_requests_total = 0
        self.draining = False

    @property
    def num_live(self) -> int:
        return len(self._live)

    def render(self, prompt: PromptInput,
               add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """The prompt text and its token ids (token-id input has no text)."""
        if prompt.token_ids is not None:
            return "", list(prompt.token_ids)
        if prompt.chat is not None:
            if not prompt.chat:
                raise InvalidRequest("chat has no messages")
            try:
                text = self.tokenizer.render_chat(prompt.chat, add_generation_prompt)
            except TemplateError as exc:
                raise InvalidRequest(str(exc)) from exc
            return text, self.tokenizer.encode(text)
        text = prompt.text or ""
        return text, self.tokenizer.encode(text) if text else []

    def prepare(self, request_id: str, model: str, prompt: PromptInput,
                raw: RawSampling) -> PreparedRequest:
        validate_model(model, self.limits)
        validate_request_id(request_id)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._live:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        _, token_ids = self.render(prompt)
        limits = dataclasses.replace(self.limits, max_kv_tokens=self.cluster.max_kv_tokens())
        validate_prompt(token_ids, limits)
        sampling = validate_sampling(raw, len(token_ids), limits)
        return PreparedRequest(request_id, token_ids, sampling)

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per step that produced tokens; the last one has a
        finish_reason. Aborts the request if the consumer stops early (client cancelled)."""
        if self.draining:
            raise NoReplica("the server is draining; send new requests elsewhere")
        if len(self._live) >= self.max_live_requests:
            raise QueueFull(f"{len(self._live)} requests are live; try again later")
        engine = self.cluster.pick_replica()
        if engine is None:
            raise NoReplica("no replica is ready to serve")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        request_id = prepared.request_id
        self._live[request_id] = engine
        self.num_requests_total += 1
        finished = False
        try:
            engine.submit(request_id, prepared.prompt_token_ids, prepared.sampling, sink)
            while True:
                out = await outputs.get()
                if out.error is not None:
                    finished = True
                    raise RequestFailed(out.error)
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._live.pop(request_id, None)
            if not finished:
                engine.abort(request_id)

    def abort(self, request_id: str) -> bool:
        engine = self._live.get(request_id)
        if engine is None:
            return False
        engine.abort(request_id)
        return True
