"""What kvcache_svc granted one request in a plan, applied to it (phase 2 of
`scheduler_svc.engine.scheduler.Scheduler.apply_plan`, which checks the reply first and keeps the
queues and counters): a grow turns into the running request's diff for the workers, an
admission makes a waiting request run and turns into its full state for them. Either way the
request's `num_computed_tokens` moves past what the step computes; after a layer-wise load
(the step computes after loading, scheduler_svc.engine.store_loads) past the load too, and a load
that comes back short moves it back once every rank has reported."""

from scheduler_svc.engine.request import Request, RequestStatus
from services.kv_wire import AdmitResult
from services.wire import NewRequest, RunningRequest


def apply_grow(request: Request, num_new: int, new_block_ids: list[list[int]],
               new_token_ids: list[int]) -> RunningRequest:
    """A running request computes `num_new` more tokens in new blocks `new_block_ids`;
    `new_token_ids`: tokens sampled since its last step (pipeline stages need them)."""
    running = RunningRequest(request_id=request.request_id,
                             num_computed_tokens=request.num_computed_tokens,
                             num_new_tokens=num_new, new_block_ids=new_block_ids,
                             new_token_ids=new_token_ids)
    request.num_computed_tokens += num_new
    return running


def apply_admission(request: Request, result: AdmitResult, slot: int = -1) -> NewRequest:
    """A waiting request runs, in the blocks `result` gives it, past its prefix hit; `slot`:
    its name while the workers hold it (StepInput's decode rows)."""
    request.status = RequestStatus.RUNNING
    request.set_blocks(result.block_ids)
    request.num_committed_blocks = result.num_committed_blocks
    request.slot = slot
    new = NewRequest(
        request_id=request.request_id, token_ids=list(request.token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        sampling=request.sampling.to_spec(request.eos_token_ids),
        block_ids=result.block_ids, num_computed_tokens=result.num_cached_tokens,
        num_new_tokens=result.num_new_tokens, cache_salt=request.cache_salt,
        num_load_tokens=result.num_load_tokens, slot=slot)
    request.num_computed_tokens = result.num_cached_tokens + result.num_new_tokens
    if result.num_load_tokens and result.num_new_tokens:    # layer-wise: computes after it
        request.num_computed_tokens += result.num_load_tokens
    request.on_worker = True
    return new
