"""worker_svc.cuda_graphs on a CPU: every graph is captured (and warmed up) on one stream made
once, shown with recording stand-ins for torch.cuda's stream and graph calls; and padding rows
do what the Triton kernels' docs say (slot -1: the cache is never written; kv_len 0: no keys),
shown on the real model through the padded buffers under TRITON_INTERPRET=1."""

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker_svc.test_gpu_path import (  # noqa: F401  (tiny_model is a fixture)
    PROMPTS,
    _greedy_steps,
    _runner,
    tiny_model,
)
from worker_svc.cuda_graphs import DecodeGraphs


class FakeCuda:
    """Records which stream each warm-up and capture ran on."""

    def __init__(self) -> None:
        self.streams: list[object] = []
        self.current: object = "default stream"
        self.captured_on: list[object] = []
        self.warmed_on: list[object] = []

    def Stream(self, device: object = None) -> object:  # noqa: N802 (torch's name)
        stream = type("FakeStream", (), {"wait_stream": lambda self, other: None})()
        self.streams.append(stream)
        return stream

    def current_stream(self, device: object = None) -> Any:
        return type("Current", (), {"wait_stream": lambda self, other: None})()

    @contextmanager
    def stream(self, stream: object):  # type: ignore[no-untyped-def]
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def graph(self, graph: object, pool: object = None, stream: object = None) -> Any:
        fake = self

        @contextmanager
        def capturing():  # type: ignore[no-untyped-def]
            before, fake.current = fake.current, ("capture", stream)
            try:
                yield
            finally:
                fake.current = before
        return capturing()


def test_every_graph_is_captured_on_one_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda()
    for name in ("Stream", "current_stream", "stream", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def forward(ids: torch.Tensor, meta: object) -> tuple[torch.Tensor, torch.Tensor]:
        where = fake.current
        if isinstance(where, tuple):
            fake.captured_on.append(where[1])
        else:
            fake.warmed_on.append(where)
        return ids.float(), ids.float()

    graphs = DecodeGraphs(forward, [1, 2, 4, 8], 4, 16, torch.device("cpu"), capture=False)
    graphs.capture = True            # the capture path, with torch.cuda's calls recorded
    graphs.capture_all()
    graphs.capture_all()             # a second capture (a new cache) reuses the stream
    (stream,) = fake.streams
    assert fake.captured_on == [stream] * 8
    assert fake.warmed_on == [stream] * 16
    assert sorted(graphs.graphs) == [1, 2, 4, 8]


def test_padding_rows_skip_the_cache_and_attend_nothing_with_triton(
        tiny_model: tuple[Path, object]) -> None:  # noqa: F811
    # 5 requests decode as a padded batch of 6: the padding row has slot -1 and no keys, so
    # the null block (all zeros when allocated) is never written, and the tokens are those
    # of plain steps.
    path, _ = tiny_model
    plain = _greedy_steps(_runner(path, "triton"), PROMPTS, 3, max_num_seqs=6)
    runner = _runner(path, "triton", padded_decode=True)
    assert _greedy_steps(runner, PROMPTS, 3, max_num_seqs=6) == plain
    graphs = runner.graphs
    assert graphs is not None and graphs.padding == (-1, 0)
    assert graphs.slot_mappings[0][5].item() == -1 and graphs.kv_lens[5].item() == 0
    for layer in runner.kv_caches:
        assert not layer[:, 0].any(), "a padding row wrote the null block"


def test_c_kernel_padding_uses_the_null_slot(tiny_model: tuple[Path, object]) -> None:  # noqa: F811
    # The C kernels take no negative slot and no empty row: their padding row writes and
    # attends the null block's slot 0, which real rows never read.
    path, _ = tiny_model
    runner = _runner(path, "c", padded_decode=True)
    _greedy_steps(runner, PROMPTS, 2, max_num_seqs=6)
    graphs = runner.graphs
    assert graphs is not None and graphs.padding == (0, 1)
    assert graphs.slot_mappings[0][5].item() == 0 and graphs.kv_lens[5].item() == 1
    assert any(layer[:, 0, 0].any() for layer in runner.kv_caches)
    assert all(not layer[:, 0, 1:].any() for layer in runner.kv_caches)
