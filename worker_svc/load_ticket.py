"""One step's KV store loads as the step's thread sees them (`LoadTicket`), and the CUDA
ordering between the loader's copies and the compute stream (`StreamOrder`). The loader
(worker_svc.kv_loader) fills a ticket on its own thread; the step's thread waits on it.

A load is either in the background or layer-wise (issue 24, point 2):
- background: the request computes nothing in the load's step; the ticket completes when its
  chunks are in, and the scheduler schedules the rest of the request after every rank's
  report (the step's forward never waits for it);
- layer-wise ("inline"): the same step computes the rest of the request's prompt, and its
  forward waits, before each layer, for that layer's KV (`wait_layer`). The loader fetches the
  chunks one group of layers at a time (`layer_ends`), so layer 0 runs as soon as its group is
  in while later groups are still on their way: a hit's first token comes about a transfer
  after its admission, not a transfer plus a forward. What every inline load got is known once
  the forward is done (`inline_loaded`); one that came back short computed on missing KV, so
  the runner drops that row's sample and rolls the request back (worker_svc.runner).
"""

import bisect
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from services.wire import KvLoaded


class StreamOrder:
    """CUDA events between the compute stream (the step's thread) and the loader's own stream
    (its thread), so that a load never races a step on the GPU: `mark_ready` and `join` run on
    the step's thread, `copying`, `mark_group` and `mark_copied` on the loader's. Tests give a
    recording twin with the same methods."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None     # made on the loader's thread

    def mark_ready(self) -> torch.cuda.Event:
        """An event after all the work queued so far on the compute stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def copying(self, ready: object) -> Iterator[None]:
        """Copies inside run on the loader's stream, after `ready` (mark_ready's event)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        self.stream.wait_event(ready)            # type: ignore[arg-type]
        with torch.cuda.stream(self.stream):
            yield

    def mark_group(self) -> torch.cuda.Event | None:
        """An event after the copies queued so far on the loader's stream (a layer group of a
        layer-wise load), not waited for on the host: the compute stream joins it."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def mark_copied(self) -> torch.cuda.Event:
        """An event after the loader's copies, waited for on the host too."""
        event = torch.cuda.Event()
        if self.stream is not None:
            event.record(self.stream)
            event.synchronize()
        return event

    def join(self, copied: object) -> None:
        """The compute stream waits for the loader's copies before anything queued later."""
        torch.cuda.current_stream(self.device).wait_event(copied)  # type: ignore[arg-type]


class LoadTicket:
    """One step's loads; `wait` returns request id -> tokens loaded (after `start`).
    `inline_ids`: the layer-wise loads (their step computes on), `layer_ends`: the end of
    each group of layers they load together (empty without inline loads)."""

    def __init__(self, step_id: int, request_ids: list[str], inline_ids: Sequence[str] = (),
                 layer_ends: Sequence[int] = ()) -> None:
        self.step_id = step_id
        self.request_ids = request_ids
        self.loaded: dict[str, int] = dict.fromkeys(request_ids, 0)
        self.ready: object | None = None    # compute-stream event recorded at start (GPU)
        self.copied: object | None = None   # loader-stream event after the last copy (GPU)
        self.order: StreamOrder | None = None   # set on a GPU: `wait_layer` joins its events
        self.inline_ids = list(inline_ids)
        self.layer_ends = list(layer_ends)
        self.group_copied: list[object | None] = [None] * len(self.layer_ends)   # GPU events
        self._group_ready = [threading.Event() for _ in self.layer_ends]
        self._inline_done = threading.Event()
        self._done = threading.Event()

    # ----------------------------------------------------------------------- the loader's side

    def group_done(self, group: int) -> None:
        """Layer group `group` of every inline load is copied (or will never be)."""
        self._group_ready[group].set()

    def inline_done(self) -> None:
        """Every inline load's count is final; releases any layer still waited for."""
        for ready in self._group_ready:
            ready.set()
        self._inline_done.set()

    def complete(self) -> None:
        self.inline_done()
        self._done.set()

    # ------------------------------------------------------------------------- the step's side

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait_layer(self, layer: int) -> None:
        """Blocks the forward until layer `layer` (of this stage) of every inline load is in
        the cache: on the host, then on the compute stream (GPU)."""
        group = bisect.bisect_right(self.layer_ends, layer)
        if group >= len(self.layer_ends):
            return
        self._group_ready[group].wait()
        event = self.group_copied[group]
        if event is not None and self.order is not None:
            self.order.join(event)

    def inline_loaded(self) -> dict[str, int]:
        """Tokens each inline load put in the cache (waits for the last of them)."""
        self._inline_done.wait()
        return {rid: self.loaded[rid] for rid in self.inline_ids}

    def report(self, worker_id: str) -> KvLoaded:
        """This rank's KvLoaded for the step (call once `done`)."""
        return KvLoaded(worker_id=worker_id, step_id=self.step_id,
                        request_ids=list(self.loaded),
                        num_loaded_tokens=list(self.loaded.values()))

    def wait(self) -> dict[str, int]:
        self._done.wait()
        return self.loaded


def layer_group_ends(num_layers: int, num_groups: int) -> list[int]:
    """Ends of `num_groups` (at most one per layer) groups of consecutive layers, sizes within
    one of each other: 30 layers in 6 groups end at 5, 10, ..., 30."""
    num_groups = max(1, min(num_groups, num_layers))
    return [(g + 1) * num_layers // num_groups for g in range(num_groups)]
