"""Launch-ahead bookkeeping: tokens sampled on the device that the host has not read.

A step's sampled ids (greedy or not) stay on the device, their copy to the host in flight, and
each sampling request holds a placeholder (`PENDING`) in its token ids. If the next step arrives
before that copy is read, its input ids take those tokens straight from the device (a decode's
input is the token just sampled), so the GPU never waits for the host; when the earlier step
finishes, its tokens are written over the placeholders.

Owned by one `ModelRunner` (worker_svc.runner): `input_ids` when it prepares a first-stage
step, `hold` from worker_svc.step_output when a step samples, `resolve` at that step's
finish, `clear` whenever the input batch is dropped.
"""

import torch

from worker_svc.input_batch import ScheduledRequest
from worker_svc.launched_step import SampledTokens

PENDING = -1   # a token sampled on the device whose value the host has not read yet


class PendingTokens:
    """The latest step whose sampled tokens are still on the device, and where each went."""

    __slots__ = ("_step", "_rows")

    def __init__(self) -> None:
        self._step: SampledTokens | None = None  # the latest step's, tokens on the device
        self._rows: dict[str, tuple[int, int]] = {}  # id -> (its row, token position)

    def clear(self) -> None:
        """Forget every pending token (the input batch holding the placeholders is gone)."""
        self._step, self._rows = None, {}

    def input_ids(self, layout: list[ScheduledRequest], device: torch.device) -> torch.Tensor:
        """The step's token ids on the device; tokens still on the device (PENDING) are taken
        from the step that sampled them, without a round trip through the host."""
        ids: list[int] = []
        fill_rows, fill_from = [], []
        for s in layout:
            c = s.num_computed_tokens
            if self._rows:
                where = self._rows.get(s.state.request_id)
                if where is not None and c <= where[1] < c + s.num_new_tokens:
                    fill_rows.append(len(ids) + where[1] - c)
                    fill_from.append(where[0])
            ids.extend(s.state.token_ids[c:c + s.num_new_tokens])
        input_ids = torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)
        if fill_rows:
            assert self._step is not None and self._step.device_tokens is not None
            rows = torch.tensor(fill_rows).to(device, non_blocking=True)
            source = torch.tensor(fill_from).to(device, non_blocking=True)
            input_ids.index_copy_(0, rows, self._step.device_tokens.index_select(0, source))
        return input_ids

    def holds(self, request_id: str) -> bool:
        """Whether the request's latest token is still on the device."""
        return request_id in self._rows

    def resolve_latest(self) -> None:
        """Wait for the latest step's tokens and write them over their placeholders (its own
        finish resolves it again, to the same tokens)."""
        if self._step is not None:
            self.resolve(self._step)

    def hold(self, sampled: SampledTokens, tokens: torch.Tensor, device: torch.device) -> None:
        """`tokens` ([len(sampled.sampling)] int64, on `device`) are a step's sampled ids:
        start their copy to the host and give each request a placeholder for its new token."""
        sampled.token_ids = None           # read at finish
        sampled.device_tokens = tokens
        sampled.logprobs = [None] * len(sampled.sampling)
        if device.type == "cuda":
            sampled.host_tokens = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
            sampled.host_tokens.copy_(tokens, non_blocking=True)
            sampled.copied = torch.cuda.Event()
            sampled.copied.record()
        else:
            sampled.host_tokens = tokens
        self._step = sampled
        self._rows = {}
        for i, s in enumerate(sampled.sampling):
            position = len(s.state.token_ids)
            self._rows[s.state.request_id] = (i, position)
            sampled.positions.append(position)
            s.state.token_ids.append(PENDING)

    def resolve(self, sampled: SampledTokens) -> list[int]:
        """Wait for `sampled`'s copy to the host, write its tokens over their placeholders
        and return them (in `sampled.sampling` order)."""
        assert sampled.host_tokens is not None
        if sampled.copied is not None:
            sampled.copied.synchronize()
        token_ids: list[int] = sampled.host_tokens.tolist()
        for s, position, token_id in zip(sampled.sampling, sampled.positions, token_ids,
                                         strict=True):
            s.state.token_ids[position] = token_id
        if self._step is sampled:
            self.clear()
        return token_ids
