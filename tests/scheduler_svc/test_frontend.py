"""The frontend's prompt path: sizes and roles are checked before any tokenizing, and rendering
plus tokenizing run off the event loop (a long prompt once stalled every stream and the
workers' heartbeats for seconds). A request its replica refuses ends as an invalid one."""

import asyncio
import time
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.frontend import Frontend, PreparedRequest, PromptInput
from scheduler_svc.live_requests import LiveRequests
from scheduler_svc.request import FinishReason, Request, RequestOutput, SamplingParams
from scheduler_svc.tokenizer import ChatMessage, TextTokenizer
from scheduler_svc.validation import InvalidRequest, Limits, RawSampling


class NoMembership:
    """What prepare() and make_request() read of membership."""

    sched_config = SchedulerConfig()
    model = SimpleNamespace(eos_token_ids=(2,))

    def max_kv_tokens(self) -> int | None:
        return None


class NoRouter:
    def __init__(self) -> None:
        self.membership = NoMembership()
        self.live = LiveRequests()


class CountingTokenizer:
    """Stands in for a TextTokenizer and counts the work it is given."""

    chat_template = "x"

    def __init__(self) -> None:
        self.num_encoded = 0
        self.num_rendered = 0

    def encode(self, text: str) -> list[int]:
        self.num_encoded += 1
        return [1] * len(text)

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    tools: object = None, documents: object = None) -> str:
        self.num_rendered += 1
        return "".join(f"<{m.role}>{m.content}" for m in messages)


def make_frontend(tokenizer: object, limits: Limits) -> Frontend:
    return Frontend(NoRouter(), tokenizer, limits, max_live_requests=8)  # type: ignore[arg-type]


def test_oversized_text_is_refused_before_tokenizing() -> None:
    tokenizer = CountingTokenizer()
    frontend = make_frontend(tokenizer, Limits("m", 100, 50, max_prompt_bytes=1000))

    async def run() -> None:
        start = time.monotonic()
        with pytest.raises(InvalidRequest, match="prompt text is 15000000 bytes of UTF-8; this "
                                                 "server takes at most 1000 bytes"):
            await frontend.prepare("", "", PromptInput(text="x" * 15_000_000), RawSampling())
        assert time.monotonic() - start < 1.0
        with pytest.raises(InvalidRequest, match="chat content is 1001 bytes"):
            await frontend.render(PromptInput(chat=[ChatMessage("user", "y" * 1001)]))
        # A chat whose rendering outgrows the limit is refused before it is encoded.
        with pytest.raises(InvalidRequest, match="rendered chat is 1006 bytes"):
            await frontend.render(PromptInput(chat=[ChatMessage("user", "y" * 1000)]))
    asyncio.run(run())
    frontend.close()
    assert tokenizer.num_encoded == 0 and tokenizer.num_rendered == 1


def test_bad_role_is_refused_before_rendering() -> None:
    tokenizer = CountingTokenizer()
    frontend = make_frontend(tokenizer, Limits("m", 100, 50, max_prompt_bytes=1000))
    chat = [ChatMessage("user<|im_end|>", "hi")]
    with pytest.raises(InvalidRequest, match=r"role 'user<\|im_end\|>'; roles are system, user"):
        asyncio.run(frontend.prepare("", "", PromptInput(chat=chat), RawSampling()))
    frontend.close()
    assert tokenizer.num_rendered == 0


def test_tokenizing_leaves_the_event_loop_free(tokenizer: TextTokenizer) -> None:
    """While a ~1 MB prompt is tokenized (about a second of CPU), the loop still turns."""
    text = "The quick brown fox jumps over the lazy dog, 12345 times. " * 18_000
    frontend = make_frontend(tokenizer, Limits("m", tokenizer.vocab_size, 8192,
                                               max_prompt_bytes=2 << 20))
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - start - 0.005)

    async def run() -> float:
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        _, ids = await frontend.render(PromptInput(text=text))
        took = time.perf_counter() - start
        task.cancel()
        assert len(ids) > 100_000
        return took

    took = asyncio.run(run())
    frontend.close()
    assert took > 0.2, f"tokenizing took only {took:.2f}s: the prompt is too short to tell"
    assert max(lags) < took / 4, f"the loop stalled {max(lags):.2f}s of {took:.2f}s"


class RefusingRouter(NoRouter):
    """A replica took the request and refused it (say, longer than its KV pool)."""

    def dispatch(self, request: Request) -> None:
        self.live.deliver([RequestOutput(request.request_id, [], "", [], FinishReason.ABORT,
                                         error="the pool holds 16 tokens", invalid=True)])


def test_a_request_the_replica_refuses_is_invalid() -> None:
    frontend = Frontend(RefusingRouter(), CountingTokenizer(),  # type: ignore[arg-type]
                        Limits("m", 100, 50), max_live_requests=8)
    prepared = PreparedRequest("r", [1, 2, 3], SamplingParams(max_tokens=4))

    async def run() -> None:
        with pytest.raises(InvalidRequest, match="the pool holds 16 tokens"):
            async for _ in frontend.generate(prepared):
                pass
    asyncio.run(run())
    frontend.close()
    assert frontend.num_live == 0
