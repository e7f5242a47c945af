"""Choices (n > 1) and the penalty parameters at the scheduler's API edge: validation, the
choices' ids and seeds, and how their outputs are interleaved and started."""

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from scheduler_svc.engine.request import FinishReason
from scheduler_svc.frontend.choices import generate_choices, split_choices
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.prompts import PreparedRequest
from scheduler_svc.frontend.streams import RequestOutput
from scheduler_svc.frontend.validation import (
    InvalidRequest,
    Limits,
    RawSampling,
    validate_sampling,
)
from services.wire import SamplingSpec

LIMITS = Limits(model_name="m", vocab_size=100, max_model_len=50)


@pytest.mark.parametrize("raw, match", [
    (RawSampling(n=0), r"n must be in \[1, 64\]"),
    (RawSampling(n=65), r"n must be in \[1, 64\]"),
    (RawSampling(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (RawSampling(min_p=float("nan")), "min_p"),
    (RawSampling(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (RawSampling(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\]"),
    (RawSampling(repetition_penalty=0.0), r"repetition_penalty must be in \(0,"),
    (RawSampling(repetition_penalty=float("inf")), "repetition_penalty"),
    (RawSampling(logit_bias=((100, 1.0),)), "logit_bias token id 100"),
    (RawSampling(logit_bias=((5, 101.0),)), r"logit_bias\[5\] must be in \[-100, 100\]"),
    (RawSampling(logit_bias=((5, 1.0), (5, 2.0))), "twice"),
    (RawSampling(logit_bias=tuple((i % 100, 0.0) for i in range(1025))), "at most 1024"),
])
def test_bad_penalties_and_n_name_the_field(raw: RawSampling, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        validate_sampling(raw, 10, LIMITS)


def test_penalties_reach_the_worker_spec_and_survive_its_codec() -> None:
    params = validate_sampling(RawSampling(
        temperature=0.7, min_p=0.1, presence_penalty=-1.0, frequency_penalty=0.5,
        repetition_penalty=1.2, logit_bias=((3, -100.0), (7, 2.5)), n=3), 10, LIMITS)
    assert params.n == 3
    spec = params.to_spec()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=SamplingSpec)
    assert decoded == spec
    assert (decoded.min_p, decoded.presence_penalty, decoded.frequency_penalty,
            decoded.repetition_penalty) == (0.1, -1.0, 0.5, 1.2)
    assert decoded.logit_bias == [(3, -100.0), (7, 2.5)]
    defaults = validate_sampling(RawSampling(), 10, LIMITS).to_spec()
    assert (defaults.min_p, defaults.presence_penalty, defaults.frequency_penalty,
            defaults.repetition_penalty, defaults.logit_bias) == (0.0, 0.0, 0.0, 1.0, [])


def test_choices_get_their_own_ids_and_distinct_seeds() -> None:
    prepared = PreparedRequest("req", [1, 2, 3], SamplingParams(seed=(1 << 64) - 2, n=3))
    choices = split_choices(prepared)
    assert [c.request_id for c in choices] == ["req-0", "req-1", "req-2"]
    assert [c.sampling.seed for c in choices] == [(1 << 64) - 2, (1 << 64) - 1, 0]
    assert all(c.sampling.n == 1 and c.prompt_token_ids == [1, 2, 3] for c in choices)
    assert split_choices(PreparedRequest("one", [1], SamplingParams())) == [
        PreparedRequest("one", [1], SamplingParams())]
    with pytest.raises(InvalidRequest, match="request_id longer"):
        split_choices(PreparedRequest("x" * 256, [1], SamplingParams(n=2)))


class ScriptedFrontend:
    """Each request yields two outputs; records when each started and what was cancelled."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[str] = []
        self.events: list[str] = []
        self.gate = asyncio.Event()

    async def generate(self, prepared: PreparedRequest,
                       time_remaining: float | None) -> AsyncIterator[RequestOutput]:
        rid = prepared.request_id
        self.started.append(rid)
        self.events.append(f"start {rid}")
        try:
            self.events.append(f"output {rid}")
            yield RequestOutput(rid, [1], "a", [None])
            await self.gate.wait()
            yield RequestOutput(rid, [2], "b", [None], finish_reason=FinishReason.STOP)
        finally:
            self.finished.append(rid)


def test_other_choices_start_after_the_first_output_of_choice_0() -> None:
    async def run() -> tuple[list[tuple[int, str]], ScriptedFrontend]:
        frontend = ScriptedFrontend()
        prepared = PreparedRequest("r", [1], SamplingParams(n=3))
        seen = []
        async for index, out in generate_choices(frontend, prepared):  # type: ignore[arg-type]
            seen.append((index, out.request_id))
            if len(seen) == 3:
                frontend.gate.set()
        return seen, frontend

    seen, frontend = asyncio.run(run())
    assert sorted(seen) == sorted((i, f"r-{i}") for i in range(3) for _ in range(2))
    assert seen[0] == (0, "r-0")
    # The others wait for choice 0's first output (its prompt is cached by then).
    assert frontend.events[:2] == ["start r-0", "output r-0"]
    assert sorted(frontend.finished) == ["r-0", "r-1", "r-2"]


def test_a_consumer_that_stops_cancels_every_choice_and_abort_skips_unstarted_ones() -> None:
    async def stop_early() -> ScriptedFrontend:
        frontend = ScriptedFrontend()
        stream = generate_choices(frontend, PreparedRequest("r", [1], SamplingParams(n=2)))  # type: ignore[arg-type]
        await anext(stream)
        await asyncio.sleep(0.01)
        await stream.aclose()
        return frontend

    frontend = asyncio.run(stop_early())
    assert sorted(frontend.finished) == sorted(frontend.started) == ["r-0", "r-1"]

    async def aborted_before_start() -> list[RequestOutput]:
        frontend = ScriptedFrontend()
        frontend.gate.set()
        aborted = asyncio.Event()
        aborted.set()
        outs = [out async for _, out in generate_choices(
            frontend, PreparedRequest("r", [1, 2], SamplingParams(n=3)),  # type: ignore[arg-type]
            aborted=aborted)]
        assert frontend.started == ["r-0"]
        return outs

    outs = asyncio.run(aborted_before_start())
    unstarted = [o for o in outs if o.request_id != "r-0"]
    assert len(unstarted) == 2
    assert all(o.finish_reason is FinishReason.ABORT and not o.new_token_ids
               and o.num_prompt_tokens == 2 for o in unstarted)
