"""A step's outputs, packed per front end: one `EngineOutputs` message for each front end
whose requests produced something (tokens, endings, logprobs), their rows as packed arrays.

The engine core (scheduler_svc.engine.core) calls `pack_outputs` with what its scheduler
returned for the step and sends each message to its front end (scheduler_svc.engine.service).
"""

from collections import defaultdict

from scheduler_svc.engine.request import RequestOutput
from scheduler_svc.engine.wire import (
    EngineOutputs,
    Finished,
    HandlePromptLogprobs,
    RowLogprobs,
    pack_ints,
)


def finished_record(out: RequestOutput) -> Finished:
    reason = out.finish_reason.value if out.finish_reason is not None else "abort"
    stop = out.stop_reason if isinstance(out.stop_reason, int) else None
    return Finished(handle=out.handle, reason=reason, stop_token_id=stop,
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_output_tokens=out.num_output_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    num_store_loaded_tokens=out.num_store_loaded_tokens,
                    error=None if out.error is None else out.error[:4096],
                    server_fault=out.server_fault, invalid=out.invalid)


class _Packer:
    __slots__ = ("handles", "token_ids", "finished", "logprobs", "prompt_logprobs")

    def __init__(self) -> None:
        self.handles: list[int] = []
        self.token_ids: list[int] = []
        self.finished: list[Finished] = []
        self.logprobs: list[RowLogprobs] = []
        self.prompt_logprobs: list[HandlePromptLogprobs] = []

    def add(self, out: RequestOutput) -> None:
        for token_id, lp in zip(out.new_token_ids, out.logprobs, strict=False):
            if lp is not None:
                self.logprobs.append(RowLogprobs(len(self.handles), lp))
            self.handles.append(out.handle)
            self.token_ids.append(token_id)
        if out.prompt_logprobs is not None:
            ids, lps, ranks = [], [], []
            for token_id, lp, rank in out.prompt_logprobs:
                ids.append(token_id)
                lps.append(lp)
                ranks.append(rank)
            self.prompt_logprobs.append(HandlePromptLogprobs(out.handle, ids, lps, ranks))
        if out.finish_reason is not None or out.error is not None:
            self.finished.append(finished_record(out))

    def message(self, replica_id: int, engine_epoch: int,
                down: str | None = None) -> EngineOutputs:
        return EngineOutputs(replica_id=replica_id, engine_epoch=engine_epoch,
                             num_rows=len(self.handles),
                             handles=pack_ints(self.handles, "<i8"),
                             token_ids=pack_ints(self.token_ids, "<i4"),
                             finished=self.finished, logprobs=self.logprobs,
                             prompt_logprobs=self.prompt_logprobs, down=down)


def pack_outputs(outputs: list[RequestOutput], replica_id: int,
                 engine_epoch: int) -> dict[int, EngineOutputs]:
    """Front end index -> its message, for every front end `outputs` name."""
    packers: defaultdict[int, _Packer] = defaultdict(_Packer)
    for out in outputs:
        packers[out.frontend].add(out)
    return {frontend: packer.message(replica_id, engine_epoch)
            for frontend, packer in packers.items()}


def down_message(replica_id: int, engine_epoch: int, reason: str) -> EngineOutputs:
    """The last message to every front end: the engine core stops."""
    return _Packer().message(replica_id, engine_epoch, down=reason[:4096])
