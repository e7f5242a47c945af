"""What the benchmark scripts share around the measurements: the shared workload, the median
of repeated rounds, and the JSON result file under bench/results/.

Imported by throughput.py, gpu_throughput.py, parallel.py and cpu_kernels.py (most of them
through throughput.py's names, which re-export these)."""

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_peer_round(generate: Callable[[list[str], int], tuple[int, float]],
                    prompts: list[str], single: str, max_tokens: int) -> dict[str, float]:
    """One round of a peer's figures from its `generate(texts, new_tokens) -> (tokens,
    seconds)`: single TTFT = a 1-token generate of the single prompt; single decode tokens/s
    = (tokens - 1) / (full generate - TTFT); batch = every prompt in one generate."""
    _, ttft = generate([single], 1)
    n, total = generate([single], max_tokens)
    count, wall = generate(prompts, max_tokens)
    return {"batch_tok_s": count / wall, "batch_wall_s": wall,
            "single_ttft_ms": ttft * 1000, "single_decode_tok_s": (n - 1) / (total - ttft)}


def load_workload() -> tuple[list[str], str, int]:
    """(prompts, single-stream prompt, new tokens per prompt) from shared/bench/workload.py,
    found beside the repository, inside it, or carried to a GPU machine as .gpu/workload.py
    (scripts/gpu-check)."""
    for candidate in (ROOT.parent / "shared" / "bench", ROOT / "shared" / "bench",
                      ROOT / ".gpu"):
        if (candidate / "workload.py").is_file():
            sys.path.insert(0, str(candidate))
            import workload  # type: ignore[import-not-found]

            return workload.PROMPTS, workload.SINGLE_PROMPT, workload.MAX_NEW_TOKENS
    raise SystemExit("shared/bench/workload.py not found beside the repository (nor "
                     ".gpu/workload.py in it)")


def medians(runs: list[dict[str, float]]) -> dict[str, object]:
    """Each figure's median over the repeats (a dict of figures: each of its own), plus the
    repeats themselves."""
    def median(key: str) -> object:
        first = runs[0][key]
        if isinstance(first, dict):
            return {k: statistics.median(r[key][k] for r in runs) for k in first}  # type: ignore[index]
        return statistics.median(r[key] for r in runs)
    return {**{key: median(key) for key in runs[0]}, "runs": runs}


def write_result(results: dict, out: str | None, stem: str) -> None:  # type: ignore[type-arg]
    """Writes the JSON result to `out`, or to bench/results/<stem>-<time>.json."""
    path = Path(out) if out else ROOT / "bench" / "results" / \
        f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
