"""Steady decodes as compact rows (services.wire.DecodeRows): the slots that name requests
while the workers hold them, and each step's rows until its output comes back.

A request gets a slot at admission (`take_slot`, in its NewRequest) and gives it back when the
workers drop its state (`release`): the slot is free again once the step carrying that drop
has been sent (`sent`), since the workers apply a step's finished ids before its new requests.
A steady decode (`is_row`) travels as its slot and progress in two packed int32 arrays
(`rows`); the step's output brings the rows' tokens back packed, in row order (`tokens`).

Owned by the engine's Scheduler (scheduler_svc.engine.scheduler).
"""

import numpy as np

from scheduler_svc.engine.request import Request
from services.wire import DecodeRows, StepOutput


class DecodeRowBook:
    """The replica's slots and the decode rows of its steps in flight."""

    __slots__ = ("_free", "_next", "_releasing", "_in_flight")

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0
        self._releasing: list[int] = []               # dropped, free once a step is sent
        self._in_flight: dict[int, list[Request]] = {}  # step id -> its rows' requests

    def take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        slot, self._next = self._next, self._next + 1
        return slot

    def release(self, request: Request) -> None:
        """The workers drop `request`'s state with the next step sent."""
        if request.slot >= 0:
            self._releasing.append(request.slot)
            request.slot = -1

    def sent(self) -> None:
        """A step went out: the slots it released may be given again."""
        self._free += self._releasing
        self._releasing = []

    @staticmethod
    def is_row(request: Request, num_new: int, new_blocks: list[list[int]]) -> bool:
        """Whether this share of a step is a steady decode: one token, the last the workers
        hold (so they sample the next), no new block, no logprobs to carry by id."""
        return (num_new == 1 and request.slot >= 0 and not any(new_blocks)
                and request.sampling.logprobs is None
                and request.num_computed_tokens + 1
                == request.num_tokens + request.num_pending_tokens)

    def rows(self, step_id: int, requests: list[Request], computed: list[int]) -> DecodeRows:
        """Step `step_id`'s rows: `requests` from `computed` tokens each."""
        self._in_flight[step_id] = requests
        return DecodeRows(slots=_pack([r.slot for r in requests]),
                          num_computed_tokens=_pack(computed))

    def tokens(self, output: StepOutput) -> list[tuple[Request, int]]:
        """The rows of `output`'s step and their tokens, but for rows the worker skipped (-1:
        a request a failed step dropped)."""
        requests = self._in_flight.pop(output.step_id, [])
        if len(output.decode_token_ids) != 4 * len(requests):
            raise RuntimeError(f"step {output.step_id}: {len(output.decode_token_ids)} bytes of "
                               f"decode tokens for {len(requests)} decode rows")
        tokens = np.frombuffer(output.decode_token_ids, dtype="<i4").tolist()
        return [(r, t) for r, t in zip(requests, tokens, strict=True) if t >= 0]

    def forget(self, step_id: int | None = None) -> None:
        """Step `step_id`'s rows (None: every step's) will never come back."""
        if step_id is None:
            self._in_flight.clear()
        else:
            self._in_flight.pop(step_id, None)


def _pack(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()
