"""What each endpoint does, between a parsed request body and a response body: the model
check (404 for another model), the parameter mapping (`http_svc.sampling`, `http_svc.chat`),
the readiness check (503 while no replica can serve), the scheduler calls and the response.

A completions request's prompts times `n` (and chat's `n`) are bounded by
--max-prompts-per-request, checked before anything is sent; a batch, streamed or not, keeps
at most `http_svc.outputs.MAX_CALLS_IN_FLIGHT` of its scheduler calls open at once.

A generation's request id is also the response's `id` (`cmpl-...`, `chatcmpl-...`; prompt i
of a batch `cmpl-...-i`), so the scheduler's logs name what the client saw. Where the output
may fill the rest of the context (chat without max_completion_tokens, completions with
`max_tokens: null`) or the assistant header is left out, the prompt is tokenized first and
sent as token ids with the room it leaves, as vLLM computes it.

Streamed responses wait for each generation's first chunk before answering, so that a
refusal by the scheduler (a prompt too long for the context, say) is an HTTP error status and
not an error event in a 200 stream (in a larger batch, for the first MAX_CALLS_IN_FLIGHT
prompts; a later one's refusal ends the stream with an error event). With continuous usage
stats the prompt is tokenized first too, so every event can count it.

A chat reply is read into content, reasoning and tool calls (`http_svc.replies`) as the
request's tool choice (`http_svc.tools`) and the server's `--reasoning-parser` say; a choice
that made calls finishes with "tool_calls" where it stopped on its own.
"""

import dataclasses
import functools
import time
import uuid
from collections.abc import Sequence
from typing import Any

from http_svc.chat import chat_extras, extras_num_bytes, flatten_messages, refuse_template_inputs
from http_svc.config import HttpConfig
from http_svc.errors import ApiError, bad_request, grpc_fields_named, not_supported
from http_svc.outputs import (
    MAX_CALLS_IN_FLIGHT,
    chat_choice,
    chat_logprobs,
    collect,
    collect_all,
    completion_choice,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_body,
    usage_body,
)
from http_svc.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from http_svc.readiness import Readiness
from http_svc.reasoning import REASONING_PARSERS
from http_svc.replies import ReplyReader
from http_svc.sampling import Sampling, chat_sampling, completion_sampling
from http_svc.scheduler_client import (
    GenerateSpec,
    GenerationCall,
    ModelCard,
    Prompt,
    SchedulerClient,
)
from http_svc.special_tokens import SpecialTokens
from http_svc.streaming import EventStream, Started, StreamHead, chat_events, completion_events
from http_svc.structured import param_of
from http_svc.tools import ToolPlan, plan_tools

# Ids one /detokenize may carry: the scheduler reads requests of at least 1 MiB, and a
# token id takes at most 5 bytes.
MAX_DETOKENIZE_IDS = 1 << 17

Body = dict[str, Any]


def _whole(stream: bool | None, sampling: Sampling) -> bool:
    """Whether a request's completion is asked for in one reply (GenerateOnce: no message per
    token between the services): not streamed, one choice (n > 1 comes interleaved on a
    stream), and no output logprobs (a reply of every token's alternatives could pass gRPC's
    message bound, where a stream sends them a step at a time; prompt logprobs come in one
    message either way)."""
    return not stream and sampling.n == 1 and sampling.logprobs is None


def _continuous(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """vLLM's continuous usage stats: asked for with include_usage, on a stream."""
    options = body.stream_options
    return bool(body.stream and options and options.include_usage
                and options.continuous_usage_stats)


def _with_tools(sampling: Sampling, plan: ToolPlan) -> Sampling:
    """The sampling a tool plan needs: the forcing grammar, the parser's special tokens."""
    if plan.structured is not None:
        if sampling.structured is not None:
            raise bad_request(f"tool_choice {plan.mode!r} forces the output's form, as "
                              f"{sampling.structured.param} does: set one of them",
                              "tool_choice")
        sampling = dataclasses.replace(sampling, structured=plan.structured)
    if plan.keep_special_tokens:
        sampling = dataclasses.replace(sampling, keep_special_tokens=True)
    return sampling


class OpenAIServing:
    def __init__(self, client: SchedulerClient, readiness: Readiness,
                 config: HttpConfig | None = None) -> None:
        self.client = client
        self.readiness = readiness
        self.config = config or HttpConfig()
        self.special = SpecialTokens(client)
        name = self.config.reasoning_parser
        self.reasoning = REASONING_PARSERS[name] if name else None

    # -- checks shared by every endpoint ----------------------------------------------------

    async def _model(self, name: str | None) -> ModelCard:
        card = await self.client.model_card()
        if name and name != card.name:
            raise ApiError(404, f"The model `{name}` does not exist (this server serves "
                                f"`{card.name}`).", "model")
        return card

    def _require_ready(self) -> None:
        if not self.readiness.ready:
            raise ApiError(503, f"no replica can serve right now: {self.readiness.why_not}")

    @staticmethod
    def _check_text(num_bytes: int, card: ModelCard, param: str) -> None:
        if card.max_prompt_bytes and num_bytes > card.max_prompt_bytes:
            raise bad_request(f"{param} is {num_bytes} bytes of UTF-8; this server takes at most "
                              f"{card.max_prompt_bytes} bytes (the model's context is "
                              f"{card.max_model_len} tokens)", param)

    @staticmethod
    def _check_ids(ids: Sequence[int], card: ModelCard, param: str) -> None:
        if len(ids) >= card.max_model_len:
            raise bad_request(f"This model's maximum context length is {card.max_model_len} "
                              f"tokens. However, your prompt has {len(ids)} tokens and at "
                              f"least one must be left to generate.", param)

    async def _fill(self, sampling: Sampling, num_prompt_tokens: int,
                    card: ModelCard) -> Sampling:
        """max_tokens for "the rest of the context" once the prompt's length is known. vLLM
        refuses to start unless its KV cache holds a whole context; a replica here may hold
        less, so the context is what the smallest replica holds, if that is less."""
        if sampling.max_tokens is not None:
            return sampling
        context = min(card.max_model_len, await self.client.kv_capacity() or card.max_model_len)
        return dataclasses.replace(sampling, max_tokens=max(1, context - num_prompt_tokens))

    # -- GET endpoints ----------------------------------------------------------------------

    async def models(self) -> Body:
        card = await self.client.model_card()
        return {"object": "list", "data": [{
            "id": card.name, "object": "model", "created": int(time.time()),
            "owned_by": "splitserve", "root": card.name, "parent": None,
            "max_model_len": card.max_model_len, "permission": []}]}

    async def _vocabulary(self, sampling: Sampling) -> list[str] | None:
        """Every token's text, where the response shows tokens (logprobs of either kind)."""
        if sampling.logprobs is None and sampling.prompt_logprobs is None:
            return None
        return await self.client.vocabulary()

    # -- completions ------------------------------------------------------------------------

    def _completion_prompts(self, prompt: Any, card: ModelCard) -> list[Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        prompts: list[Prompt] = []
        for i, p in enumerate(prompt):
            param = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                self._check_text(len(p.encode("utf-8", "surrogatepass")), card, param)
                prompts.append(Prompt(text=p))
            else:
                self._check_ids(p, card, param)
                prompts.append(Prompt(token_ids=tuple(p)))
        return prompts

    def _check_fan_out(self, num_prompts: int, n: int, param: str) -> None:
        """Each prompt times n is a scheduler request of its own (n > 1: one request with n
        choices): bounded per HTTP request, before anything is sent."""
        limit = self.config.max_prompts_per_request
        if num_prompts * n > limit:
            raise bad_request(f"{param}: {num_prompts} prompts x n {n} is more than "
                              f"--max-prompts-per-request {limit}", param)

    async def completions(self, body: CompletionRequest) -> Body | EventStream:
        card = await self._model(body.model)
        sampling = completion_sampling(body)
        num_prompts = _num_prompts(body.prompt)
        self._check_fan_out(num_prompts, sampling.n, "prompt" if num_prompts > 1 else "n")
        prompts = self._completion_prompts(body.prompt, card)
        self._require_ready()
        with grpc_fields_named("prompt", structured_param=param_of(sampling.structured)):
            return await self._complete(body, card, sampling, prompts)

    async def _echoes(self, prompts: list[Prompt]) -> list[str]:
        """Each prompt's text as `echo` returns it (token ids decoded, special tokens kept)."""
        ids = [p.token_ids or () for p in prompts if p.text is None]
        decoded = iter(await self.client.detokenize(ids) if ids else [])
        return [p.text if p.text is not None else next(decoded) for p in prompts]

    async def _complete(self, body: CompletionRequest, card: ModelCard, sampling: Sampling,
                        prompts: list[Prompt]) -> Body | EventStream:
        echoes = await self._echoes(prompts) if body.echo else None
        # With echo and logprobs, the logprobs start with the prompt's tokens: its first one
        # (which has no logprob) comes from here, the others with their prompt logprobs.
        first_ids = None
        if echoes is not None and sampling.logprobs is not None:
            first_ids = [(p.token_ids or (await self.client.tokenize(p))[0] or (0,))[0]
                         for p in prompts]
        continuous = _continuous(body)
        if sampling.max_tokens is None or continuous or not body.add_special_tokens:
            prompts = [p if p.token_ids is not None else Prompt(token_ids=tuple(
                await self.special.text_ids(p.text or "", body.add_special_tokens)))
                for p in prompts]
        vocab = await self._vocabulary(sampling)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        specs = [GenerateSpec(response_id if len(prompts) == 1 else f"{response_id}-{i}", p,
                              await self._fill(sampling, len(p.token_ids or ()), card),
                              body.cache_salt or "") for i, p in enumerate(prompts)]
        head = StreamHead(response_id, "text_completion", int(time.time()), card.name)
        if body.stream:
            started = await _start([self.client.generate(s) for s in specs[:MAX_CALLS_IN_FLIGHT]])
            options = body.stream_options
            return completion_events(head, started, sampling, vocab,
                                     bool(options and options.include_usage), echoes,
                                     first_ids, [len(p.token_ids or ()) for p in prompts]
                                     if continuous else None,
                                     [functools.partial(self.client.generate, spec)
                                      for spec in specs[MAX_CALLS_IN_FLIGHT:]])
        per_prompt = await collect_all(self.client.generate, specs,
                                       _whole(body.stream, sampling), sampling.n)
        results = [r for choices_of_prompt in per_prompt for r in choices_of_prompt]
        choices = []
        for i, r in enumerate(results):
            # Choice 0 of each prompt carries the prompt's logprobs.
            prompt_lps = per_prompt[i // sampling.n][0].prompt_logprobs
            logprobs = None
            if vocab is not None and sampling.logprobs is not None:
                num_top = sampling.logprobs
                if first_ids is None:
                    logprobs = completion_logprobs(vocab, r.logprobs, num_top)
                else:
                    first = first_ids[i // sampling.n]
                    offset = len(vocab[first]) + sum(len(vocab[lp.token_id])
                                                     for lp in prompt_lps)
                    logprobs = echo_logprobs(vocab, first, prompt_lps, num_top,
                                             completion_logprobs(vocab, r.logprobs, num_top,
                                                                 offset))
            assert r.last is not None
            text = (echoes[i // sampling.n] if echoes else "") + r.text
            choice = completion_choice(i, text, logprobs, r.last, sampling)
            if vocab is not None and body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(vocab, prompt_lps,
                                                                 body.prompt_logprobs)
            choices.append(choice)
        return {"id": head.id, "object": "text_completion", "created": head.created,
                "model": head.model, "choices": choices,
                "usage": usage_body([r.usage for r in results], sampling.n)}

    # -- chat completions -------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest) -> Body | EventStream:
        card = await self._model(body.model)
        sampling = chat_sampling(body)
        self._check_fan_out(1, sampling.n, "n")
        refuse_template_inputs(body)
        plan = plan_tools(body, self.config)
        sampling = _with_tools(sampling, plan)
        messages = tuple(flatten_messages(body.messages))
        extras = chat_extras(body)
        self._check_text(sum(len(c.encode("utf-8", "surrogatepass")) for _, c in messages)
                         + extras_num_bytes(extras), card, "messages")
        self._require_ready()
        with grpc_fields_named("messages", "top_logprobs", param_of(sampling.structured)):
            return await self._chat(body, card, sampling, Prompt(chat=messages,
                                                                 chat_extras=extras), plan)

    async def _chat(self, body: ChatCompletionRequest, card: ModelCard, sampling: Sampling,
                    prompt: Prompt, plan: ToolPlan) -> Body | EventStream:
        messages = prompt.chat or ()
        num_prompt_tokens = None
        if (sampling.max_tokens is None or not body.add_generation_prompt or _continuous(body)
                or body.add_special_tokens):
            ids, _ = await self.client.tokenize(prompt, body.add_generation_prompt)
            ids = await self.special.chat_ids(ids, body.add_special_tokens)
            prompt, num_prompt_tokens = Prompt(token_ids=tuple(ids)), len(ids)
            sampling = await self._fill(sampling, len(ids), card)
        role = "assistant" if body.add_generation_prompt else messages[-1][0]
        # vLLM's chat echo: the last message's content, where it has the reply's role.
        echo = messages[-1][1] if body.echo and messages[-1][0] == role else ""
        vocab = await self._vocabulary(sampling)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        call = self.client.generate(GenerateSpec(response_id, prompt, sampling,
                                                 body.cache_salt or ""),
                                    _whole(body.stream, sampling))
        head = StreamHead(response_id, "chat.completion.chunk", int(time.time()), card.name)
        if body.stream:
            (started,) = await _start([call])
            options = body.stream_options
            return chat_events(head, role, started, sampling, vocab,
                               bool(options and options.include_usage), echo,
                               lambda: ReplyReader(plan, self.reasoning),
                               num_prompt_tokens if _continuous(body) else None)
        try:
            results = await collect(call, sampling.n)
        finally:
            call.cancel()
        choices = []
        for i, result in enumerate(results):
            logprobs = None
            if vocab is not None and sampling.logprobs is not None:
                logprobs = chat_logprobs(vocab, result.logprobs, sampling.logprobs)
            assert result.last is not None
            reader = ReplyReader(plan, self.reasoning)
            reply = reader.read(echo + result.text)
            finish = ("tool_calls" if reader.made_calls and result.last.finish_reason == "stop"
                      else None)
            choices.append(chat_choice(i, role, echo + result.text, logprobs, result.last,
                                       sampling, reply.message(role), finish))
        response = {"id": head.id, "object": "chat.completion", "created": head.created,
                    "model": head.model, "choices": choices,
                    "usage": usage_body([r.usage for r in results], sampling.n)}
        if vocab is not None and sampling.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_body(
                vocab, results[0].prompt_logprobs, sampling.prompt_logprobs)
        return response

    # -- tokenizer endpoints ----------------------------------------------------------------

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> Body:
        card = await self._model(body.model)
        if body.return_token_strs:
            raise not_supported("return_token_strs")
        if isinstance(body, TokenizeChatRequest):
            refuse_template_inputs(body)
            messages = tuple(flatten_messages(body.messages))
            extras = chat_extras(body)
            self._check_text(sum(len(c.encode("utf-8", "surrogatepass")) for _, c in messages)
                             + extras_num_bytes(extras), card, "messages")
            ids, _ = await self.client.tokenize(Prompt(chat=messages, chat_extras=extras),
                                                body.add_generation_prompt)
            ids = await self.special.chat_ids(ids, body.add_special_tokens)
        else:
            self._check_text(len(body.prompt.encode("utf-8", "surrogatepass")), card, "prompt")
            ids = await self.special.text_ids(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": card.max_model_len, "tokens": ids,
                "token_strs": None}

    async def tokenizer_info(self) -> Body:
        """vLLM's /tokenizer_info, from what the gRPC API tells of the tokenizer: enough for
        a remote tokenizer (lm-eval's) to know the context and the end of a turn."""
        card = await self._model(None)
        eos = await self.client.detokenize([[i] for i in card.eos_token_ids])
        return {"tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": card.max_model_len, "vocab_size": card.vocab_size,
                "eos_token": eos[0] if eos else None,
                "eos_token_id": card.eos_token_ids[0] if card.eos_token_ids else None,
                "eos_token_ids": list(card.eos_token_ids)}

    async def detokenize(self, body: DetokenizeRequest) -> Body:
        card = await self._model(body.model)
        if len(body.tokens) > MAX_DETOKENIZE_IDS:
            raise bad_request(f"tokens has {len(body.tokens)} ids; at most "
                              f"{MAX_DETOKENIZE_IDS} are taken", "tokens")
        bad = next((t for t in body.tokens if t >= card.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary "
                              f"(0..{card.vocab_size - 1})", "tokens")
        (text,) = await self.client.detokenize([body.tokens])
        return {"prompt": text}


def _num_prompts(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds: a string or a list of token ids is
    one, a list of either is one each."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)


async def _start(calls: Sequence[GenerationCall]) -> list[Started]:
    """Each call with its first chunk; on any failure every call is cancelled."""
    try:
        return [Started(call, await call.next()) for call in calls]
    except BaseException:
        for call in calls:
            call.cancel()
        raise
