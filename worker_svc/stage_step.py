"""One step on one pipeline stage: the part of the worker's step loop (worker_svc.step_loop)
that talks to the previous and next stage.

`launch_stage` receives the previous stage's activations (non-first stages), launches the
step on the runner and, on a non-last stage, finishes it and sends its activations on. A step
of no tokens (it only loads KV from the store) sends and receives nothing: every stage sees
the same StepInput, so all skip alike.
"""

import logging

import torch

from services.wire import StepInput
from worker_svc.launched_step import LaunchedStep, StageActivations
from worker_svc.parallel import ParallelGroups, PeerLost
from worker_svc.shard_runner import ShardRunner

log = logging.getLogger(__name__)


def num_step_tokens(step: StepInput) -> int:
    return (sum(r.num_new_tokens for r in step.new_requests)
            + sum(r.num_new_tokens for r in step.running)
            + (len(step.decodes.slots) // 4 if step.decodes is not None else 0))


def launch_stage(runner: ShardRunner, step: StepInput,
                 link: ParallelGroups | None) -> LaunchedStep:
    """Launch one step on this stage: activations in from the previous stage; a non-last
    stage sends its activations on to the next (the returned step is then finished)."""
    forwards = link is not None and link.next_rank is not None
    num_tokens = num_step_tokens(step)
    try:
        stage_input = None
        if link is not None and link.prev_rank is not None:
            if num_tokens == 0:
                empty = torch.empty(0, runner.config.hidden_size, dtype=runner.dtype,
                                    device=runner.device)
                stage_input = StageActivations(empty, empty)
            else:
                stage_input = StageActivations(*link.recv(
                    num_tokens, runner.config.hidden_size, runner.dtype, runner.device))
        launched = runner.launch(step, stage_input)
        if not forwards:
            return launched
        result = runner.finish(launched)
        assert isinstance(result, StageActivations)
    except Exception:
        # The next stage is waiting for this step's activations: tell it the step failed,
        # or it would sit in its receive until the group's timeout.
        if forwards and num_tokens:
            assert link is not None
            try:
                link.send_failure()
            except PeerLost as lost:   # the next stage is the one gone
                log.warning("could not tell the next stage: %s", lost)
        raise
    assert link is not None
    if num_tokens:
        link.send(result.hidden_states, result.residual)
    return launched
