"""The HTTP front end's edge to the scheduler: the public gRPC API (`splitserve.v1.Generation`)
over one grpc.aio channel. Protobuf stops here: callers hand in and get back the plain types
below. Every gRPC error leaves as an `ApiError` with the matching HTTP status.

Cached per model (refreshed by `forget_model`, which the readiness watch calls whenever it
reconnects, since a restarted scheduler may serve another model): the ModelInfo card and
the vocabulary's texts, one per token id, each decoded on its own as vLLM decodes logprob
tokens (fetched once, in slices, through Detokenize). For a few seconds: the KV capacity of
the smallest replica (ServerInfo), which bounds "the rest of the context".

Every call carries the key the HTTP client presented (http_svc.auth) as the scheduler's API
key metadata; a Generate call without keys also declares the HTTP client's host as the
client the scheduler queues its requests for (`splitserve-client`: each client's requests
are admitted in turn). The channel is TLS when a CA to trust the scheduler with is given.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from http_svc.auth import client_host, presented_key
from http_svc.chat import ChatExtras
from http_svc.errors import ApiError, from_grpc
from http_svc.sampling import Sampling
from http_svc.structured import to_pb as structured_to_pb
from services import tls
from services.api_keys import CLIENT_METADATA_KEY, MAX_DECLARED_CLIENT_LEN, call_metadata
from services.grpc_server import CHANNEL_OPTIONS
from services.rpc.splitserve.v1 import generation_pb2 as pb
from services.rpc.splitserve.v1 import generation_pb2_grpc

UNARY_TIMEOUT_S = 60.0
# gRPC's default reconnect backoff grows to 2 minutes: a front end that saw the scheduler down
# for a while would go on answering 503 that long after it came back. At most 1 s here.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                     ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
VOCAB_SLICE = 8192        # one-token sequences per Detokenize call for the vocabulary
CAPACITY_TTL_S = 5.0      # how long a ServerInfo reading of the replicas' KV capacity is used


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the front end needs of ModelInfo."""

    name: str                 # the served model name
    max_model_len: int        # context length in tokens
    vocab_size: int
    max_prompt_bytes: int     # longest text prompt (or chat content) in UTF-8 bytes
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Prompt:
    """Exactly one of the three is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[tuple[str, str], ...] | None = None    # (role, content)
    chat_extras: ChatExtras | None = None   # with chat: tools, documents, messages' tool fields


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    request_id: str
    prompt: Prompt
    sampling: Sampling
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int                         # the sampled token
    logprob: float
    top: tuple[tuple[int, float], ...]    # the best alternatives, best first
    rank: int = 0                         # prompt logprobs: the token's rank (1 = best)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed GenerateResponse; the last has `finish_reason` and `usage`."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]    # one per token id when logprobs were asked for
    finish_reason: str | None = None      # "stop", "length" or "abort"
    stop_reason: str | None = None        # the stop string or stop token id (as text)
    usage: Usage | None = None
    index: int = 0                        # the choice (of the request's n) it belongs to
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # prompt tokens from the second on


def spec_to_pb(spec: GenerateSpec) -> pb.GenerateRequest:
    s = spec.sampling
    sampling = pb.SamplingParams(
        min_tokens=s.min_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos)
    # Knobs the client left unset stay unset: the scheduler applies the model's defaults.
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if (value := getattr(s, name)) is not None:
            setattr(sampling, name, value)
    if s.seed is not None:
        sampling.seed = s.seed
    if s.max_tokens is not None:
        sampling.max_tokens = s.max_tokens
    if s.logprobs is not None:
        sampling.logprobs = s.logprobs
    if s.structured is not None:
        sampling.structured_output.CopyFrom(structured_to_pb(s.structured))
    if s.n != 1:
        sampling.n = s.n
    if s.include_stop_str_in_output:
        sampling.include_stop_str_in_output = True
    if s.presence_penalty:
        sampling.presence_penalty = s.presence_penalty
    if s.frequency_penalty:
        sampling.frequency_penalty = s.frequency_penalty
    sampling.logit_bias.update(s.logit_bias)
    if s.prompt_logprobs is not None:
        sampling.prompt_logprobs = s.prompt_logprobs
    request = pb.GenerateRequest(request_id=spec.request_id, sampling=sampling,
                                 keep_special_tokens=s.keep_special_tokens,
                                 cache_salt=spec.cache_salt)
    prompt = spec.prompt
    if prompt.text is not None:
        request.text = prompt.text
    elif prompt.token_ids is not None:
        request.token_ids.ids.extend(prompt.token_ids)
    else:
        request.chat.CopyFrom(chat_to_pb(prompt))
    return request


def chat_to_pb(prompt: Prompt) -> pb.ChatMessages:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c)
                                     for r, c in prompt.chat or ()])
    extras = prompt.chat_extras
    if extras is not None:
        for message, (name, tool_call_id, tool_calls_json) in zip(chat.messages,
                                                                  extras.messages):
            message.name, message.tool_call_id = name, tool_call_id
            message.tool_calls_json = tool_calls_json
        chat.tools_json, chat.documents_json = extras.tools_json, extras.documents_json
        chat.chat_template_kwargs_json = extras.template_kwargs_json
    return chat


def chunk_from_pb(msg: pb.GenerateResponse) -> Chunk:
    usage = None
    if msg.finish_reason:
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens,
                      msg.usage.cached_prompt_tokens)
    return Chunk(
        token_ids=tuple(msg.token_ids), text=msg.text,
        logprobs=tuple(TokenLogprob(lp.token_id, lp.logprob,
                                    tuple((t.token_id, t.logprob) for t in lp.top))
                       for lp in msg.logprobs),
        finish_reason=msg.finish_reason or None,
        stop_reason=msg.stop_reason if msg.HasField("stop_reason") else None, usage=usage,
        index=msg.index,
        prompt_logprobs=tuple(TokenLogprob(lp.token_id, lp.logprob,
                                           tuple((t.token_id, t.logprob) for t in lp.top),
                                           lp.rank) for lp in msg.prompt_logprobs))


class GenerationCall:
    """One running Generate stream, or GenerateOnce call (its one reply as the only chunk):
    `next()` or iterate for its chunks (one iterator, so iterating after `next()` goes on from
    there). `cancel()` ends the gRPC call, and the scheduler then aborts the request (its
    consumer went away)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall | grpc.aio.UnaryUnaryCall) -> None:
        self._call = call
        self._chunks = self._read()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks

    async def next(self) -> Chunk:
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            raise ApiError(500, "the scheduler ended the stream without a result") from None

    async def _read(self) -> AsyncIterator[Chunk]:
        try:
            if isinstance(self._call, grpc.aio.UnaryUnaryCall):
                yield chunk_from_pb(await self._call)
                return
            async for msg in self._call:
                yield chunk_from_pb(msg)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


class SchedulerClient:
    """Built inside the event loop that serves HTTP (grpc.aio channels belong to one).
    `ssl_ca`: a PEM file of the CA(s) to trust the scheduler's TLS port with (None:
    plaintext)."""

    def __init__(self, address: str, ssl_ca: str | None = None) -> None:
        self.address = address
        options = CHANNEL_OPTIONS + RECONNECT_OPTIONS
        self.channel = grpc.aio.insecure_channel(address, options=options) if ssl_ca is None \
            else grpc.aio.secure_channel(address, tls.channel_credentials(ssl_ca), options)
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._card: ModelCard | None = None
        self._vocabulary: tuple[ModelCard, list[str]] | None = None
        self._vocabulary_lock = asyncio.Lock()
        self._capacity: tuple[float, int | None] | None = None   # (read at, tokens)

    async def close(self) -> None:
        await self.channel.close()

    def forget_model(self) -> None:
        self._card = None

    async def model_card(self) -> ModelCard:
        if self._card is None:
            info = await self._unary(self._stub.ModelInfo, pb.ModelInfoRequest())
            self._card = ModelCard(info.model, info.max_model_len, info.vocab_size,
                                   info.max_prompt_bytes, tuple(info.eos_token_ids))
        return self._card

    async def kv_capacity(self) -> int | None:
        """Tokens (prompt and output) one request can hold on the smallest replica with a KV
        pool, as the scheduler checks it; None while no replica has one."""
        now = time.monotonic()
        if self._capacity is None or now - self._capacity[0] > CAPACITY_TTL_S:
            info = await self._unary(self._stub.ServerInfo, pb.ServerInfoRequest())
            pools = [(r.num_kv_blocks, r.block_size) for r in info.replicas if r.num_kv_blocks]
            tokens = min((n - 1) * size for n, size in pools) if pools else None
            self._capacity = (now, tokens)
        return self._capacity[1]

    def generate(self, spec: GenerateSpec, whole: bool = False) -> GenerationCall:
        """`whole`: the client wants the completion only when it is done (a non-streaming
        request with one choice): GenerateOnce, so that no message is sent per token."""
        metadata = call_metadata(presented_key.get())
        if (host := client_host.get()) is not None:
            metadata += ((CLIENT_METADATA_KEY, host[:MAX_DECLARED_CLIENT_LEN]),)
        if whole:
            return GenerationCall(self._stub.GenerateOnce(spec_to_pb(spec), metadata=metadata))
        return GenerationCall(self._stub.Generate(spec_to_pb(spec), metadata=metadata))

    async def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True,
                       ) -> tuple[list[int], str]:
        """The prompt's token ids and the text they came from (the rendered chat)."""
        request = pb.TokenizeRequest(no_generation_prompt=not add_generation_prompt)
        if prompt.chat is not None:
            request.chat.CopyFrom(chat_to_pb(prompt))
        else:
            request.text = prompt.text or ""
        response = await self._unary(self._stub.Tokenize, request)
        return list(response.token_ids), response.prompt

    async def detokenize(self, sequences: Sequence[Sequence[int]],
                         skip_special_tokens: bool = False) -> list[str]:
        request = pb.DetokenizeRequest(
            sequences=[pb.TokenIds(ids=ids) for ids in sequences],
            skip_special_tokens=skip_special_tokens)
        return list((await self._unary(self._stub.Detokenize, request)).texts)

    async def vocabulary(self) -> list[str]:
        """Every token id's text, decoded on its own (special tokens kept)."""
        card = await self.model_card()
        async with self._vocabulary_lock:
            if self._vocabulary is None or self._vocabulary[0] != card:
                texts: list[str] = []
                for start in range(0, card.vocab_size, VOCAB_SLICE):
                    end = min(start + VOCAB_SLICE, card.vocab_size)
                    texts += await self.detokenize([[i] for i in range(start, end)])
                self._vocabulary = (card, texts)
            return self._vocabulary[1]

    async def _unary(self, method: grpc.aio.UnaryUnaryMultiCallable, request: Any) -> Any:
        try:
            return await method(request, timeout=UNARY_TIMEOUT_S,
                                metadata=call_metadata(presented_key.get()))
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from None

