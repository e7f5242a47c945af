"""bench/worker_host_step.py drives real decode steps through the null runner: one time per
decode step, each positive, on a tiny model."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from host_ceiling import build_model  # noqa: E402
from worker_host_step import decode_step_ms  # noqa: E402


def test_one_time_per_decode_step(tmp_path: Path) -> None:
    model = build_model(tmp_path / "model")
    times = decode_step_ms(model, rows=4, num_steps=6)
    assert len(times) == 6 and all(t > 0 for t in times)
