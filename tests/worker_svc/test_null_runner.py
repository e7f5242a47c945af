"""NullRunner (worker_svc.null_runner, with null_sampler and null_device) driven by hand-made
StepInputs: deterministic tokens that are never EOS, the EOS share at its step, the emulated
device's timing (ready, finish, launching ahead, gaps), the real runner's diff checks, KV
sizing without tensors, and placement's refusal of more than one rank."""

import json
import time
from pathlib import Path

import pytest
import torch

from scripts.random_family import family_config
from services.flags import FlagParser
from services.model_config import ModelConfig
from services.rpc.splitserve.v1 import control_pb2
from services.service_flags import add_worker_flags
from services.wire import (
    IDLE_GAP_S,
    NewRequest,
    RunningRequest,
    SamplingSpec,
    StepInput,
    StepOutput,
    TokenMask,
)
from tests.worker_svc.common import GREEDY
from worker_svc.__main__ import null_model_options
from worker_svc.config import WorkerConfig
from worker_svc.kernels.cpu import CpuLevel
from worker_svc.null_device import EmulatedDevice
from worker_svc.null_runner import NullModelOptions, NullRunner
from worker_svc.null_sampler import client_request_id, echo_token, ends_early, first_allowed
from worker_svc.placement import Placer
from worker_svc.token_mask import mask_num_bytes

EOS = (2, 5)
VOCAB = 64
BLOCK_SIZE = 4
NUM_BLOCKS = 256
CONFIG = ModelConfig(name="tiny", architecture="llama", vocab_size=VOCAB, hidden_size=32,
                     intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_model_len=256,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_ids=EOS)
# EOS ids inside the prompt: the echo must skip them.
PROMPT = [7, 2, 9, 11, 5, 13]


def runner(**options: object) -> NullRunner:
    r = NullRunner(CONFIG, torch.float32, "w0", NullModelOptions(**options))  # type: ignore[arg-type]
    r.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    return r


class Blocks:
    """Block ids handed out in order, enough for each request's tokens."""

    def __init__(self) -> None:
        self.next = 1
        self.held: dict[str, int] = {}

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        need = -(-num_tokens // BLOCK_SIZE) - self.held.get(request_id, 0)
        ids = list(range(self.next, self.next + max(0, need)))
        self.next += len(ids)
        self.held[request_id] = self.held.get(request_id, 0) + len(ids)
        return ids


def prefill(blocks: Blocks, prompts: dict[str, list[int]], step_id: int = 0,
            sampling: SamplingSpec = GREEDY) -> StepInput:
    return StepInput(step_id, [NewRequest(rid, list(p), len(p), sampling,
                                          [blocks.grow(rid, len(p))], 0, len(p))
                               for rid, p in prompts.items()], [], [])


def decode(blocks: Blocks, num_tokens: dict[str, int], step_id: int,
           masks: list[TokenMask] | None = None) -> StepInput:
    """One token for each request, which holds `num_tokens[rid]` computed tokens so far."""
    return StepInput(step_id, [], [RunningRequest(rid, n, 1, [blocks.grow(rid, n + 1)], [])
                                   for rid, n in num_tokens.items()], [], masks or [])


def generate(r: NullRunner, prompts: dict[str, list[int]], num_new_tokens: int,
             sampling: SamplingSpec = GREEDY) -> dict[str, list[int]]:
    """Prefill, then decodes one step at a time; every request's output tokens."""
    blocks = Blocks()
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    step = prefill(blocks, prompts, sampling=sampling)
    for step_id in range(1, num_new_tokens + 1):
        result = r.execute(step)
        assert isinstance(result, StepOutput) and result.error is None
        for rid, token_id in zip(result.request_ids, result.sampled_token_ids, strict=True):
            out[rid].append(token_id)
        step = decode(blocks, {rid: len(p) + step_id - 1 for rid, p in prompts.items()},
                      step_id)
    return out


def test_tokens_echo_the_prompt_are_deterministic_and_never_eos() -> None:
    prompts = {"a": PROMPT, "b": [3, 4, 6], "c": [2, 5, 2, 8]}
    first = generate(runner(), prompts, 14)
    assert first == generate(runner(), prompts, 14)
    for rid, prompt in prompts.items():
        assert first[rid] == [echo_token(prompt, i, frozenset(EOS), 0) for i in range(14)]
        assert not set(first[rid]) & set(EOS)
    assert first["a"][:6] == [7, 9, 9, 11, 13, 13]     # EOS ids skipped forward
    assert first["c"] == [8] * 14
    assert echo_token([2, 5], 3, frozenset(EOS), 0) == 0   # nothing but EOS: the fallback


def test_the_eos_share_samples_eos_at_its_step() -> None:
    ids = [f"req-{i}" for i in range(60)]
    out = generate(runner(eos_step=3, eos_share=0.5), {rid: PROMPT for rid in ids}, 5)
    early = {rid for rid in ids if ends_early(rid, 0.5)}
    assert 15 < len(early) < 45                       # about half, by the id's hash
    for rid in ids:
        tokens = out[rid]
        assert (tokens[2] == EOS[0]) == (rid in early), rid
        assert not set(tokens[:2] + tokens[3:]) & set(EOS)
    assert all(ends_early(rid, 1.0) for rid in ids) and not any(ends_early(r, 0.0) for r in ids)
    # The scheduler's front ends suffix the client's id; the share follows the client's id.
    assert [ends_early(f"{rid}#1.a3", 0.5) for rid in ids] == [rid in early for rid in ids]
    assert client_request_id("a#b#0.1f") == "a#b" and client_request_id("a#b") == "a#b"


def test_ready_and_finish_wait_for_the_emulated_device() -> None:
    r = runner(step_ms=60)
    started = time.perf_counter()
    launched = r.launch(prefill(Blocks(), {"a": PROMPT}))
    assert not launched.ready()
    result = r.finish(launched)
    assert time.perf_counter() - started >= 0.06
    assert launched.ready()
    assert isinstance(result, StepOutput)
    assert result.timings.forward_ms == 60 and result.timings.num_tokens == len(PROMPT)
    assert result.timings.prepare_ms < 60


def test_launching_ahead_queues_behind_the_step_before() -> None:
    """The step loop's overlap: step 2 is launched before step 1 is finished; its device work
    starts when step 1's ends (no gap), and its input is step 1's token, still pending."""
    r = runner(step_ms=40)
    blocks = Blocks()
    first = r.launch(prefill(blocks, {"a": PROMPT}))
    second = r.launch(decode(blocks, {"a": len(PROMPT)}, 1))
    assert r.last_input_ids is not None and r.last_input_ids.tolist() == [7]   # pending token
    assert second.done_at == pytest.approx(first.done_at + 0.04)
    assert not first.ready() and not second.ready()
    out1, out2 = r.finish(first), r.finish(second)
    assert isinstance(out1, StepOutput) and isinstance(out2, StepOutput)
    assert (out1.sampled_token_ids, out2.sampled_token_ids) == ([7], [9])
    assert out2.timings.gap_ms == 0.0
    assert r.input_batch is not None and r.input_batch.requests["a"].token_ids[-2:] == [7, 9]


def test_gap_is_the_emulated_devices_idle_time() -> None:
    device = EmulatedDevice()
    assert device.queue(10.0, 0.002) == (10.002, 0.0)          # the first step: not measured
    end, gap = device.queue(10.001, 0.002)                      # launched ahead
    assert (end, gap) == (pytest.approx(10.004), 0.0)
    end, gap = device.queue(10.010, 0.002)                      # 6 ms idle
    assert (end, gap) == (pytest.approx(10.012), pytest.approx(6.0))
    assert device.queue(12.0 + IDLE_GAP_S, 0.0)[1] == 0.0       # an idle server
    device.reset()
    assert device.queue(20.0, 0.0)[1] == 0.0


def test_gap_measured_between_steps_on_the_runner() -> None:
    r = runner(step_ms=10)
    blocks = Blocks()
    r.execute(prefill(blocks, {"a": PROMPT}))
    time.sleep(0.03)
    out = r.execute(decode(blocks, {"a": len(PROMPT)}, 1))
    assert isinstance(out, StepOutput)
    assert 25 <= out.timings.gap_ms < 500


def test_a_bad_diff_raises_value_error_and_drops_the_steps_requests() -> None:
    r = runner()
    blocks = Blocks()
    r.execute(prefill(blocks, {"a": PROMPT}))
    with pytest.raises(ValueError, match="not held"):
        r.launch(decode(blocks, {"ghost": 3}, 1))
    with pytest.raises(ValueError, match="computed"):
        r.launch(decode(blocks, {"a": 2}, 2))
    assert r.input_batch is not None and "a" not in r.input_batch.requests   # discarded
    failed = r.failed_output(decode(blocks, {"a": 2}, 3), ValueError("x"))
    assert failed.error is not None and failed.request_ids == []


def test_a_load_from_the_kv_store_is_refused() -> None:
    step = StepInput(0, [NewRequest("a", PROMPT, len(PROMPT), GREEDY, [[1, 2]], 0, 0,
                                    num_load_tokens=4)], [], [])
    with pytest.raises(ValueError, match="no KV store"):
        runner().launch(step)


def test_logprobs_and_prompt_logprobs_are_plausible() -> None:
    sampling = SamplingSpec(temperature=0.8, top_p=0.9, top_k=-1, seed=3, num_logprobs=3,
                            num_prompt_logprobs=2)
    r = runner()
    out = r.execute(prefill(Blocks(), {"a": PROMPT}, sampling=sampling))
    assert isinstance(out, StepOutput)
    assert out.sampled_token_ids == [7]
    lp = out.logprobs[0]
    assert lp is not None and lp.logprob == 0.0
    assert lp.top_token_ids[0] == 7 and len(set(lp.top_token_ids)) == 3
    assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    (prompt,) = out.prompt_logprobs
    assert prompt.first_position == 1 and len(prompt.logprobs) == len(PROMPT) - 1
    assert [e.top_token_ids[0] for e in prompt.logprobs] == PROMPT[1:]
    assert prompt.ranks == [1] * (len(PROMPT) - 1)


def test_a_token_mask_gives_its_first_allowed_token() -> None:
    words = [0] * (mask_num_bytes(VOCAB) // 4)
    words[1] = (1 << 3) | (1 << 9)                  # tokens 35 and 41
    bitmask = b"".join(w.to_bytes(4, "little") for w in words)
    assert first_allowed(bitmask) == 35
    r = runner()
    blocks = Blocks()
    r.execute(prefill(blocks, {"a": PROMPT, "b": PROMPT}))
    out = r.execute(decode(blocks, {"a": len(PROMPT), "b": len(PROMPT)}, 1,
                           [TokenMask("b", bitmask)]))
    assert isinstance(out, StepOutput) and out.sampled_token_ids == [9, 35]
    with pytest.raises(ValueError, match="bytes"):
        r.launch(decode(blocks, {"a": len(PROMPT) + 1}, 2, [TokenMask("a", b"\0" * 4)]))
    with pytest.raises(ValueError, match="no token"):
        first_allowed(b"\0" * 8)


def test_no_metadata_changes_no_token() -> None:
    prompts = {"a": PROMPT, "b": [3, 4, 6]}
    assert generate(runner(metadata=False), prompts, 6) == generate(runner(), prompts, 6)


def test_kv_capacity_comes_from_the_cap_and_the_real_page_size() -> None:
    r = NullRunner(CONFIG, torch.bfloat16, "w0", NullModelOptions())
    per_block = 2 * 16 * CONFIG.num_kv_heads * CONFIG.head_dim * 2 * CONFIG.num_layers
    assert r.kv_bytes_per_block(16) == per_block
    budget = r.measure_kv_budget(16, 2048, 256, 1 << 20)
    assert budget.budget == 1 << 20
    assert r.num_blocks_for_budget(budget.budget, 16) == (1 << 20) // per_block
    assert r.kv_saver is None and r.kv_loader is None


@pytest.fixture
def null_placer(tmp_path: Path) -> Placer:
    (tmp_path / "config.json").write_text(json.dumps(family_config("llama")))
    return Placer(WorkerConfig(
        scheduler_address="localhost:1", model_path=str(tmp_path), host="127.0.0.1",
        advertise_host="127.0.0.1", port=0, worker_id="w", epoch=1,
        device=torch.device("cpu"), kv_cache_bytes=1 << 20, gpu_memory_utilization=0.9,
        num_threads=1, quant_kernels=True, cpu_level=CpuLevel.NONE, register_timeout_s=1.0,
        null_model=NullModelOptions(step_ms=1.0)))


def test_placement_builds_the_null_runner_for_one_rank(null_placer: Placer) -> None:
    placed = null_placer.place(control_pb2.RegisterResponse(
        first_layer=0, end_layer=2, pp_size=1, tp_size=1, block_size=16, dtype="float32"),
        None)
    assert placed is not None
    runner, num_blocks = placed
    assert isinstance(runner, NullRunner)
    assert num_blocks == (1 << 20) // runner.kv_bytes_per_block(16)


@pytest.mark.parametrize("pp, tp", [(2, 1), (1, 2)])
def test_placement_refuses_more_than_one_rank(null_placer: Placer, pp: int, tp: int,
                                              caplog: pytest.LogCaptureFixture) -> None:
    placement = control_pb2.RegisterResponse(first_layer=0, end_layer=1, pp_size=pp,
                                             tp_size=tp, block_size=16, dtype="float32")
    assert null_placer.place(placement, None) is None
    assert "--null-model runs one rank" in caplog.text


def test_the_null_flags_become_options_and_need_null_model() -> None:
    p = add_worker_flags(FlagParser(environ={}))
    a = p.parse_args(["--null-model", "--null-step-ms", "1.92", "--null-eos-step", "4",
                      "--null-eos-share", "0.25", "--null-no-metadata"])
    assert null_model_options(p, a) == NullModelOptions(1.92, 4, 0.25, metadata=False)
    assert null_model_options(p, p.parse_args([])) is None
    for argv in (["--null-step-ms", "2"], ["--null-model", "--null-eos-step", "-1"]):
        with pytest.raises(SystemExit):
            null_model_options(p, p.parse_args(argv))
    for argv in (["--null-step-ms", "-1"], ["--null-eos-share", "1.5"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
