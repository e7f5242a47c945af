"""A step's outputs, packed per front end: one `EngineOutputs` message for each front end
whose requests produced something (tokens, endings, logprobs), their rows as packed arrays.

Two ways in, one message out:
- the packed path: the scheduler's `update_packed` puts each sampled token straight into a
  `StepPacker` (a row: handle, token), and only what a row needs beside it (an ending,
  logprobs, prompt logprobs) as a record: no object per token;
- the object path: `pack_outputs` packs `RequestOutput`s (an abort's or a failed step's
  endings, and the scheduler's reference `update`, which the packed path must equal:
  tests/scheduler_svc/engine/test_packed_path.py).

The engine core (scheduler_svc.engine.core) sends each message to its front end
(scheduler_svc.engine.service).
"""

from scheduler_svc.engine.request import RequestOutput
from scheduler_svc.engine.wire import (
    EngineOutputs,
    Finished,
    HandlePromptLogprobs,
    RowLogprobs,
    pack_ints,
)
from services.wire import TokenLogprobs


def finished_record(out: RequestOutput) -> Finished:
    reason = out.finish_reason.value if out.finish_reason is not None else "abort"
    stop = out.stop_reason if isinstance(out.stop_reason, int) else None
    return Finished(handle=out.handle, reason=reason, stop_token_id=stop,
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_output_tokens=out.num_output_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    num_store_loaded_tokens=out.num_store_loaded_tokens,
                    error=None if out.error is None else out.error[:4096],
                    server_fault=out.server_fault, invalid=out.invalid, timing=out.timing)


class Packer:
    """One front end's share of a step."""

    __slots__ = ("handles", "token_ids", "finished", "logprobs", "prompt_logprobs")

    def __init__(self) -> None:
        self.handles: list[int] = []
        self.token_ids: list[int] = []
        self.finished: list[Finished] = []
        self.logprobs: list[RowLogprobs] = []
        self.prompt_logprobs: list[HandlePromptLogprobs] = []

    def token(self, handle: int, token_id: int, logprobs: TokenLogprobs | None) -> None:
        if logprobs is not None:
            self.logprobs.append(RowLogprobs(len(self.handles), logprobs))
        self.handles.append(handle)
        self.token_ids.append(token_id)

    def prompt(self, handle: int, prompt: list[tuple[int, TokenLogprobs, int]]) -> None:
        ids, lps, ranks = [], [], []
        for token_id, lp, rank in prompt:
            ids.append(token_id)
            lps.append(lp)
            ranks.append(rank)
        self.prompt_logprobs.append(HandlePromptLogprobs(handle, ids, lps, ranks))

    def add(self, out: RequestOutput) -> None:
        """An output of the object path."""
        for token_id, lp in zip(out.new_token_ids, out.logprobs, strict=False):
            self.token(out.handle, token_id, lp)
        if out.prompt_logprobs is not None:
            self.prompt(out.handle, out.prompt_logprobs)
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


class StepPacker:
    """Every front end's share of one step, filled by the scheduler's packed path."""

    __slots__ = ("packers",)

    def __init__(self) -> None:
        self.packers: dict[int, Packer] = {}

    def of(self, frontend: int) -> Packer:
        packer = self.packers.get(frontend)
        if packer is None:
            packer = self.packers[frontend] = Packer()
        return packer

    def add(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.of(out.frontend).add(out)

    def messages(self, replica_id: int, engine_epoch: int) -> dict[int, EngineOutputs]:
        """Front end index -> its message (only front ends the step had anything for)."""
        return {frontend: packer.message(replica_id, engine_epoch)
                for frontend, packer in self.packers.items()}


def pack_outputs(outputs: list[RequestOutput], replica_id: int,
                 engine_epoch: int) -> dict[int, EngineOutputs]:
    """Front end index -> its message, for every front end `outputs` name."""
    packer = StepPacker()
    packer.add(outputs)
    return packer.messages(replica_id, engine_epoch)


def down_message(replica_id: int, engine_epoch: int, reason: str) -> EngineOutputs:
    """The last message to every front end: the engine core stops."""
    return Packer().message(replica_id, engine_epoch, down=reason[:4096])
