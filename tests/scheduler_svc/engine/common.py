"""Helpers for the scheduler's unit tests: a scheduler planning against kvcache_svc's real
block manager in-process, and hand-made step outputs."""

from kvcache_svc.block_manager import ReplicaBlockManager
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.request import Request, SamplingParams
from scheduler_svc.engine.scheduler import Scheduler
from services.kv_wire import PlanReply, PlanRequest
from services.wire import StepInput, StepOutput, StepTimings

EOS = 2


def make_scheduler(num_blocks: int = 64, **overrides: object) -> tuple[Scheduler,
                                                                        ReplicaBlockManager]:
    # Steady decodes travel as RunningRequests here (the helpers below name rows by id);
    # tests of the compact rows (services.wire.DecodeRows) turn them on.
    knobs = {"compact_decodes": False}
    knobs.update({k: overrides.pop(k) for k in ("ship_sampled_tokens", "num_batches",
                                                "async_scheduling", "compact_decodes")
                  if k in overrides})
    cfg = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 4,
                             "max_model_len": 1024, **overrides})  # type: ignore[arg-type]
    sched = Scheduler(cfg, **knobs)  # type: ignore[arg-type]
    sched.set_capacity(num_blocks)
    return sched, ReplicaBlockManager(num_blocks, cfg.block_size, cfg.prefix_caching,
                                      group_windows=cfg.kv_group_windows)


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 4,
        cache_salt: bytes = b"", **kw: object) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw),  # type: ignore[arg-type]
                  (EOS,), sched.config.max_model_len, sched.config.block_size,
                  hash_blocks=sched.config.prefix_caching, cache_salt=cache_salt)
    sched.add_request(req)
    return req


def applied(kv: ReplicaBlockManager, plan: PlanRequest | None) -> PlanReply | None:
    """kvcache_svc's reply to a drafted plan (None: the step needed no plan call)."""
    return None if plan is None else kv.apply(plan)


def step(sched: Scheduler, kv: ReplicaBlockManager) -> StepInput | None:
    return sched.apply_plan(applied(kv, sched.schedule()))


def sample(step_input: StepInput, tokens: dict[str, int]) -> StepOutput:
    """What a last-stage worker would answer: a token for every request whose scheduled
    tokens reach the end of what it knows."""
    ids = [rid for rid in tokens]
    return StepOutput(step_id=step_input.step_id, worker_id="w", request_ids=ids,
                      sampled_token_ids=[tokens[r] for r in ids], logprobs=[None] * len(ids),
                      timings=StepTimings(0.0, 0.0, 0.0, 0))


def scheduled(step_input: StepInput) -> dict[str, int]:
    out = {r.request_id: r.num_new_tokens for r in step_input.new_requests}
    out.update({r.request_id: r.num_new_tokens for r in step_input.running})
    return out
