"""ModelRunner driven by hand-made StepInputs: chunked prefill, decode, pipeline stages."""

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from services.model_config import ModelConfig
from services.wire import (
    DecodeRows,
    NewRequest,
    RunningRequest,
    SamplingSpec,
    StepInput,
    StepOutput,
)
from tests.worker_svc.common import GREEDY, PROMPTS, assert_greedy_match, hf_greedy
from worker_svc.launched_step import StageActivations
from worker_svc.pending_tokens import PENDING
from worker_svc.runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 128
NUM_NEW_TOKENS = 12


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    sampling: SamplingSpec
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sent: bool = False
    unsent_token_ids: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.token_ids) - self.num_prompt_tokens >= self.max_tokens


class MiniScheduler:
    """Just enough of a scheduler to drive workers: token budget, chunked prefill, blocks."""

    def __init__(self, token_budget: int, send_tokens: bool, compact: bool = False):
        self.token_budget = token_budget
        self.send_tokens = send_tokens        # pipeline parallel: ship sampled tokens to ranks
        # Steady decodes as compact rows named by slot (services.wire.DecodeRows).
        self.compact = compact
        self.decode_rows: dict[int, list[str]] = {}     # step id -> its rows' request ids
        self.requests: dict[str, _Request] = {}
        self.next_block = 1
        self.step_id = 0
        self.finished: list[str] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int,
            sampling: SamplingSpec = GREEDY) -> None:
        self.requests[request_id] = _Request(request_id, list(prompt), len(prompt), max_tokens,
                                             sampling)

    def schedule(self) -> StepInput:
        budget = self.token_budget
        new_requests, running, rows = [], [], []
        for slot, req in enumerate(self.requests.values()):
            num_new = min(len(req.token_ids) - req.num_computed_tokens, budget)
            if req.done or num_new == 0:
                continue
            budget -= num_new
            end = req.num_computed_tokens + num_new
            num_more_blocks = max(0, -(-end // BLOCK_SIZE) - len(req.block_ids))
            new_block_ids = list(range(self.next_block, self.next_block + num_more_blocks))
            self.next_block += num_more_blocks
            req.block_ids += new_block_ids
            if not req.sent:
                new_requests.append(NewRequest(
                    req.request_id, list(req.token_ids), req.num_prompt_tokens, req.sampling,
                    [list(req.block_ids)], req.num_computed_tokens, num_new,
                    slot=slot if self.compact else -1))
                req.sent = True
            elif (self.compact and num_new == 1 and not new_block_ids
                  and end == len(req.token_ids)):
                rows.append((req.request_id, slot, req.num_computed_tokens))
            else:
                running.append(RunningRequest(
                    req.request_id, req.num_computed_tokens, num_new, [new_block_ids],
                    req.unsent_token_ids if self.send_tokens else []))
            req.unsent_token_ids = []
            req.num_computed_tokens = end
        decodes = None
        if rows:
            self.decode_rows[self.step_id] = [rid for rid, _, _ in rows]
            decodes = DecodeRows(
                slots=np.asarray([slot for _, slot, _ in rows], "<i4").tobytes(),
                num_computed_tokens=np.asarray([c for _, _, c in rows], "<i4").tobytes())
        step = StepInput(self.step_id, new_requests, running, self.finished, decodes=decodes)
        self.step_id += 1
        self.finished = []
        return step

    def update(self, output: StepOutput) -> None:
        rows = self.decode_rows.pop(output.step_id, [])
        row_tokens = np.frombuffer(output.decode_token_ids, dtype="<i4").tolist()
        assert len(row_tokens) == len(rows)
        for request_id, token_id in [*zip(output.request_ids, output.sampled_token_ids,
                                          strict=True), *zip(rows, row_tokens)]:
            req = self.requests[request_id]
            req.token_ids.append(token_id)
            req.unsent_token_ids.append(token_id)
            if req.done:
                self.finished.append(request_id)

    @property
    def has_work(self) -> bool:
        return not all(req.done for req in self.requests.values())

    def outputs(self, request_id: str) -> list[int]:
        req = self.requests[request_id]
        return req.token_ids[req.num_prompt_tokens:]


@pytest.fixture(scope="module")
def runner(model_path: Path, model_config: ModelConfig) -> ModelRunner:
    runner = ModelRunner(model_config, model_path, torch.float32, "worker-0")
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    return runner


@pytest.fixture(scope="module")
def hf_reference(hf_model) -> dict[str, tuple[list[int], list]]:  # type: ignore[no-untyped-def]
    return {name: hf_greedy(hf_model, prompt, NUM_NEW_TOKENS) for name, prompt in PROMPTS.items()}


def test_chunked_prefill_and_decode_match_hf_greedy(
        runner: ModelRunner, hf_reference: dict[str, tuple[list[int], list]]) -> None:
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    # A budget of 7 tokens spreads the prompts over several steps, chunks starting mid-block,
    # mixed with other requests' decodes.
    scheduler = MiniScheduler(token_budget=7, send_tokens=False)
    for name, prompt in PROMPTS.items():
        scheduler.add(name, prompt, NUM_NEW_TOKENS)
    num_steps = 0
    gaps = []
    while scheduler.has_work:
        output = runner.execute(scheduler.schedule())
        assert isinstance(output, StepOutput)
        assert output.worker_id == "worker-0" and output.timings.num_tokens > 0
        gaps.append(output.timings.gap_ms)
        scheduler.update(output)
        num_steps += 1
        # The runner keeps its own sampled tokens: its buffers are the scheduler's.
        for name in output.request_ids:
            assert runner.input_batch.requests[name].token_ids == \
                scheduler.requests[name].token_ids
    assert num_steps > NUM_NEW_TOKENS + 3
    # Back-to-back steps: the time between forwards is measured (prepare included) and small.
    assert all(0 < g < 1000 for g in gaps[1:]), gaps
    for name in PROMPTS:
        assert_greedy_match(scheduler.outputs(name), *hf_reference[name])


@pytest.mark.parametrize("budget", [7, 64])
def test_compact_decode_rows_match_hf_greedy(
        runner: ModelRunner, hf_reference: dict[str, tuple[list[int], list]],
        budget: int) -> None:
    """Steady decodes as DecodeRows (slots and packed counts, tokens back packed), mixed with
    prefill chunks and decodes that take a new block (RunningRequests): the same greedy
    tokens as HF."""
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    scheduler = MiniScheduler(token_budget=budget, send_tokens=False, compact=True)
    for name, prompt in PROMPTS.items():
        scheduler.add(name, prompt, NUM_NEW_TOKENS)
    num_rows = 0
    while scheduler.has_work:
        step = scheduler.schedule()
        num_rows += 0 if step.decodes is None else len(step.decodes.slots) // 4
        output = runner.execute(step)
        assert isinstance(output, StepOutput)
        # A decode row's token travels only in decode_token_ids.
        assert not set(output.request_ids) & set(scheduler.decode_rows.get(step.step_id, []))
        scheduler.update(output)
    assert num_rows > NUM_NEW_TOKENS
    for name in PROMPTS:
        assert_greedy_match(scheduler.outputs(name), *hf_reference[name])


def test_prefix_hit_and_outputs_in_step_order(
        runner: ModelRunner, hf_reference: dict[str, tuple[list[int], list]]) -> None:
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    prompt = PROMPTS["chat: What is 2+2?"]                       # 16 tokens, 4 full blocks
    first = runner.execute(StepInput(0, [NewRequest("a", prompt, len(prompt), GREEDY,
                                                    [[1, 2, 3, 4]], 0, len(prompt))], [], []))
    # "b" reuses a's first three blocks (12 cached tokens) and computes the rest; "c" starts.
    logprob_spec = SamplingSpec(0.0, 1.0, -1, None, 3)
    second = runner.execute(StepInput(1, [
        NewRequest("c", prompt[:5], 5, GREEDY, [[7, 8]], 0, 5),
        NewRequest("b", prompt, len(prompt), logprob_spec, [[1, 2, 3, 5]], 12, 4),
    ], [RunningRequest("a", 16, 1, [[6]], [])], []))
    assert isinstance(first, StepOutput) and isinstance(second, StepOutput)
    assert second.request_ids == ["c", "b", "a"]
    reference, near_tie = hf_reference["chat: What is 2+2?"]
    assert_greedy_match(first.sampled_token_ids, reference[:1], near_tie)
    assert second.sampled_token_ids[1] == first.sampled_token_ids[0]
    assert_greedy_match(second.sampled_token_ids[2:], reference[1:2], near_tie[1:])
    lp = second.logprobs[1]
    assert lp is not None and lp.top_token_ids[0] == first.sampled_token_ids[0]
    assert second.logprobs[0] is None


def test_seeded_request_resumes_identically_after_preemption(runner: ModelRunner) -> None:
    seeded = SamplingSpec(temperature=1.0, top_p=0.9, top_k=40, seed=2024, num_logprobs=None)
    prompt = PROMPTS["Once upon a time, in a small village,"]

    def run(preempt_after: int | None) -> list[int]:
        runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
        scheduler = MiniScheduler(token_budget=64, send_tokens=False)
        scheduler.add("s", prompt, 6, seeded)
        steps = 0
        while scheduler.has_work:
            if steps == preempt_after:       # recompute: drop the worker state, send it anew
                scheduler.finished.append("s")
                req = scheduler.requests["s"]
                req.sent, req.num_computed_tokens, req.block_ids = False, 0, []
            scheduler.update(runner.execute(scheduler.schedule()))
            steps += 1
        return scheduler.outputs("s")

    assert run(preempt_after=3) == run(preempt_after=None)


SAMPLED_SPECS = {
    "seeded": SamplingSpec(temperature=0.9, top_p=0.9, top_k=40, seed=11, num_logprobs=None),
    "logprobs": SamplingSpec(temperature=0.7, top_p=1.0, top_k=-1, seed=12, num_logprobs=2),
    "penalties": SamplingSpec(temperature=0.8, top_p=1.0, top_k=-1, seed=13, num_logprobs=None,
                              repetition_penalty=1.3, frequency_penalty=0.5),
    "greedy": GREEDY,
}


def _sampled_run(runner: ModelRunner, ahead: bool) -> tuple[dict[str, list[int]], list]:
    """Every SAMPLED_SPECS request decodes 6 tokens, one step each after a joint prefill;
    `ahead`: each step launched before the one before it finished (async scheduling: the
    step names the token still being sampled, its placeholder included)."""
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    prompt = PROMPTS["Once upon a time, in a small village,"]
    names = list(SAMPLED_SPECS)
    blocks = {n: [1 + 8 * i + b for b in range(8)] for i, n in enumerate(names)}
    out: dict[str, list[int]] = {n: [] for n in names}
    logprobs = []
    steps = [StepInput(0, [NewRequest(n, prompt, len(prompt), SAMPLED_SPECS[n], [blocks[n]], 0,
                                      len(prompt)) for n in names], [], [])]
    steps += [StepInput(k, [], [RunningRequest(n, len(prompt) + k - 1, 1, [[]], [])
                                for n in names], []) for k in range(1, 6)]

    def take(launched) -> None:  # type: ignore[no-untyped-def]
        output = runner.finish(launched)
        for n, t, lp in zip(output.request_ids, output.sampled_token_ids, output.logprobs,
                            strict=True):
            out[n].append(t)
            if lp is not None:
                logprobs.append(lp)

    previous = None
    for step in steps:
        launched = runner.launch(step)
        if ahead:
            # Launch never read the device for this step: its tokens are placeholders.
            assert all(runner.input_batch.requests[n].token_ids[-1] == PENDING for n in names)
        if previous is not None:
            take(previous)
        previous = launched
        if not ahead:
            take(previous)
            previous = None
    if previous is not None:
        take(previous)
    return out, logprobs


def test_sampled_steps_launch_ahead_as_greedy_ones_do(runner: ModelRunner) -> None:
    """Seeded, logprobs and penalty requests: their tokens stay on the device at launch (the
    next step takes them from there), and the tokens and logprobs are those of a run that
    finished every step before the next."""
    ahead, ahead_logprobs = _sampled_run(runner, ahead=True)
    waited, waited_logprobs = _sampled_run(runner, ahead=False)
    assert ahead == waited and all(len(tokens) == 6 for tokens in ahead.values())
    assert ahead_logprobs == waited_logprobs and len(ahead_logprobs) == 6


def test_pipeline_stages_match_hf_greedy(
        model_path: Path, model_config: ModelConfig,
        hf_reference: dict[str, tuple[list[int], list]]) -> None:
    stages = [ModelRunner(model_config, model_path, torch.float32, "pp0", 0, 13, False),
              ModelRunner(model_config, model_path, torch.float32, "pp1", 13, None, True)]
    for stage in stages:
        stage.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    scheduler = MiniScheduler(token_budget=9, send_tokens=True)
    names = ["The capital of France is", "def fibonacci(n):"]
    for name in names:
        scheduler.add(name, PROMPTS[name], NUM_NEW_TOKENS)
    while scheduler.has_work:
        step = scheduler.schedule()
        activations = stages[0].execute(step)
        assert isinstance(activations, StageActivations)
        output = stages[1].execute(step, activations)
        assert isinstance(output, StepOutput)
        # Stage 0 fed its layers from its own buffer, which learnt the sampled tokens from
        # the step's new_token_ids.
        expected_ids = [t for s in (step.new_requests + step.running) for t in
                        scheduler.requests[s.request_id].token_ids[
                            s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]]
        assert sorted(stages[0].last_input_ids.tolist()) == sorted(expected_ids)
        scheduler.update(output)
        for name in output.request_ids:
            # Stage 0 is one token behind: it learns this one with the next step.
            assert stages[0].input_batch.requests[name].token_ids == \
                scheduler.requests[name].token_ids[:-1]
    for name in names:
        assert_greedy_match(scheduler.outputs(name), *hf_reference[name])


def test_kv_sizing(runner: ModelRunner, model_config: ModelConfig) -> None:
    per_block = 2 * 16 * model_config.num_kv_heads * model_config.head_dim * 4
    assert runner.kv_bytes_per_block(16) == model_config.num_layers * per_block
    assert runner.num_blocks_for_budget(10 * runner.kv_bytes_per_block(16) + 5, 16) == 10


def test_bad_steps_raise(model_path: Path, runner: ModelRunner) -> None:
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(ValueError, match="not held"):
        runner.execute(StepInput(0, [], [RunningRequest("ghost", 0, 1, [[]], [])], []))
    with pytest.raises(ValueError, match="block ids"):
        runner.execute(StepInput(0, [NewRequest("x", [1, 2], 2, GREEDY, [[NUM_BLOCKS]], 0, 2)],
                                 [], []))
    with pytest.raises(ValueError, match="stage_input"):
        runner.execute(StepInput(0, [], [], []),
                       StageActivations(torch.zeros(0, 1), torch.zeros(0, 1)))
    empty = runner.execute(StepInput(1, [], [], ["never-seen"]))
    assert isinstance(empty, StepOutput) and empty.request_ids == []


def test_failed_step_drops_its_requests_and_the_next_step_runs(
        runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    monkeypatch.setattr(runner, "fail_request_prefix", "bad")
    a, b, c = (PROMPTS[name] for name in list(PROMPTS)[:3])
    first = runner.execute(StepInput(0, [NewRequest("a", a, len(a), GREEDY, [[1, 2]], 0, len(a))],
                                     [], []))
    assert isinstance(first, StepOutput) and first.request_ids == ["a"]
    failing = StepInput(1, [NewRequest("bad-1", b, len(b), GREEDY, [[3, 4]], 0, len(b))],
                        [RunningRequest("a", len(a), 1, [[]], [])], [])
    with pytest.raises(RuntimeError, match="injected fault") as caught:
        runner.execute(failing)
    answer = runner.failed_output(failing, caught.value)
    assert answer.step_id == 1 and answer.request_ids == [] and answer.error is not None
    assert "injected fault" in answer.error.message and not answer.error.kv_written
    assert runner.input_batch is not None and not runner.input_batch.requests
    # A step sent before the scheduler heard of the failure still names a: skipped, and c
    # (which may reuse nothing of theirs) runs as on a fresh worker.
    step = runner.execute(StepInput(2, [NewRequest("c", c, len(c), GREEDY, [[5, 6, 7]], 0,
                                                   len(c))],
                                    [RunningRequest("a", len(a) + 1, 1, [[]], [])], []))
    assert isinstance(step, StepOutput) and step.request_ids == ["c"] and step.error is None
    step = runner.execute(StepInput(3, [], [RunningRequest("c", len(c), 1, [[]], [])],
                                    ["a", "bad-1"]))
    assert isinstance(step, StepOutput) and step.request_ids == ["c"]
    assert not runner.input_batch.discarded_ids
    outputs = runner.input_batch.requests["c"].token_ids[len(c):]
    alone = MiniScheduler(token_budget=64, send_tokens=False)
    alone.add("c", c, 2)
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    while alone.has_work:
        alone.update(runner.execute(alone.schedule()))
    assert outputs == alone.outputs("c")


def test_failure_after_the_forward_reports_kv_written(
        runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_logits(*args: object, **kwargs: object) -> None:
        raise FloatingPointError("probabilities contain nan")

    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    monkeypatch.setattr(type(runner.model), "compute_logits", broken_logits)
    a = PROMPTS["def fibonacci(n):"]
    failing = StepInput(0, [NewRequest("a", a, len(a), GREEDY, [[1, 2]], 0, len(a))], [], [])
    with pytest.raises(FloatingPointError) as caught:
        runner.execute(failing)
    error = runner.failed_output(failing, caught.value).error
    assert error is not None and error.kv_written
    assert error.message == "FloatingPointError: probabilities contain nan"
    assert runner.input_batch is not None and not runner.input_batch.requests
