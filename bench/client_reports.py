"""What bench/http_clients.py reads back from the clients it runs: guidellm's JSON report (a
benchmark per profile) in a few figures, and two lm-eval runs of the same tasks (splitserve
through `local-completions`, HF transformers through `hf`) compared score by score and
document by document. Pure functions over the clients' own output formats, stdlib only."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class GuidellmRun:
    """One guidellm benchmark (one profile) in the figures the bench prints."""

    profile: str
    completed: int
    errored: int
    incomplete: int
    output_tok_s: float         # output tokens of completed requests / benchmark duration
    ttft_p50_ms: float
    itl_p50_ms: float
    errors: list[str] = field(default_factory=list)   # the errored requests' messages


def guidellm_runs(report: dict[str, Any]) -> list[GuidellmRun]:
    """Each benchmark of a guidellm 0.8 JSON report (`--output kind=json`)."""
    runs = []
    for bench in report["benchmarks"]:
        metrics = bench["metrics"]
        totals = metrics["request_totals"]
        out_tokens = metrics["output_token_count"]["successful"]["total_sum"]
        duration = float(bench["duration"])
        errored = bench.get("requests", {}).get("errored") or []
        runs.append(GuidellmRun(
            profile=str(bench["config"]["strategy"]["type_"]),
            completed=int(totals["successful"]), errored=int(totals["errored"]),
            incomplete=int(totals["incomplete"]),
            output_tok_s=out_tokens / duration if duration > 0 else 0.0,
            ttft_p50_ms=float(metrics["time_to_first_token_ms"]["successful"]["median"]),
            itl_p50_ms=float(metrics["inter_token_latency_ms"]["successful"]["median"]),
            errors=[str(r.get("info", {}).get("error")) for r in errored]))
    return runs


def guidellm_failures(runs: list[GuidellmRun], expected: int) -> list[str]:
    """Why a profile failed, one line each: an errored or unfinished request, or fewer
    completed than the `expected` requests per profile."""
    failures = []
    for run in runs:
        if run.errored or run.incomplete or run.completed != expected:
            first = f"; first error: {run.errors[0]}" if run.errors else ""
            failures.append(f"guidellm {run.profile}: {run.completed} of {expected} completed, "
                            f"{run.errored} errored, {run.incomplete} incomplete{first}")
    return failures


def replay_body(report: dict[str, Any], model: str, max_tokens: int) -> dict[str, Any]:
    """A request body as guidellm sent it, to replay for the server's own answer (guidellm
    keeps only the HTTP status line of a refusal): the first errored request's, else any
    request's it kept; guidellm 0.8.1 keeps none for errored requests, and then it is the
    body its completions handler builds for a streamed synthetic request (`format` in
    guidellm/backends/openai/request_handlers.py; the `stop: null` it sets is dropped
    before sending)."""
    for kind in ("errored", "successful", "incomplete"):
        for bench in report["benchmarks"]:
            for req in bench.get("requests", {}).get(kind) or []:
                if req.get("request_args"):
                    return json.loads(req["request_args"])["body"]  # type: ignore[no-any-return]
    return {"model": model, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": max_tokens, "ignore_eos": True, "prompt": "Hello, my name is"}


def lm_eval_scores(out_dir: Path) -> dict[str, tuple[str, float]]:
    """Task -> (metric, value) from the one results_*.json under an lm-eval --output_path."""
    found = sorted(out_dir.rglob("results_*.json"))
    if len(found) != 1:
        raise FileNotFoundError(f"{out_dir}: expected one results_*.json, found {len(found)}")
    results = json.loads(found[0].read_text())["results"]
    scores = {}
    for task, row in results.items():
        metric = next(k for k in row if k.endswith(",none") and "_stderr" not in k)
        scores[task] = (metric.split(",")[0], float(row[metric]))
    return scores


def lm_eval_samples(out_dir: Path, task: str) -> dict[int, dict[str, Any]]:
    """doc_id -> the logged sample (--log_samples) of `task` under an lm-eval --output_path."""
    found = sorted(out_dir.rglob(f"samples_{task}_*.jsonl"))
    if len(found) != 1:
        raise FileNotFoundError(f"{out_dir}: expected one samples_{task}_*.jsonl, "
                                f"found {len(found)}")
    rows = (json.loads(line) for line in found[0].read_text().splitlines() if line.strip())
    return {int(r["doc_id"]): r for r in rows}


def _loglikelihoods(sample: dict[str, Any]) -> list[float]:
    """A multiple_choice sample's per-choice loglikelihoods (filtered_resps: [ll, greedy])."""
    return [float(resp[0]) for resp in sample["filtered_resps"]]


@dataclass
class TaskComparison:
    """One task, splitserve (`ours`) against the HF oracle (`theirs`)."""

    task: str
    metric: str
    ours: float
    theirs: float
    disagreements: list[str]     # one line per document whose outcome differs
    max_abs_ll_diff: float       # multiple choice: the largest |loglikelihood difference|
    min_margin: float | None     # multiple choice, HF: the smallest best-vs-second gap

    @property
    def equal(self) -> bool:
        return self.ours == self.theirs and not self.disagreements


def compare_task(task: str, metric: str, ours: float, theirs: float,
                 ours_samples: dict[int, dict[str, Any]],
                 theirs_samples: dict[int, dict[str, Any]]) -> TaskComparison:
    """Per document: generations must be the same text, multiple choice must pick the same
    choice (and so score the same); the loglikelihood gaps are reported alongside, so that a
    flip can be told apart as a near-tie (a gap below the numeric difference) or not."""
    if set(ours_samples) != set(theirs_samples):
        raise ValueError(f"{task}: the runs scored different documents")
    lines: list[str] = []
    max_diff, min_margin = 0.0, float("inf")
    for doc_id in sorted(ours_samples):
        a, b = ours_samples[doc_id], theirs_samples[doc_id]
        score_a, score_b = a.get(metric), b.get(metric)
        if isinstance(a["filtered_resps"][0], list):        # loglikelihood per choice
            lla, llb = _loglikelihoods(a), _loglikelihoods(b)
            max_diff = max(max_diff, *(abs(x - y) for x, y in zip(lla, llb, strict=True)))
            ranked = sorted(llb, reverse=True)
            margin = ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")
            min_margin = min(min_margin, margin)
            pick_a, pick_b = lla.index(max(lla)), llb.index(max(llb))
            if pick_a != pick_b or score_a != score_b:
                lines.append(f"{task} doc {doc_id}: splitserve picks {pick_a} ({lla}), HF "
                             f"picks {pick_b} ({llb}), HF margin {margin:.2e}")
        elif a["filtered_resps"] != b["filtered_resps"] or score_a != score_b:
            lines.append(f"{task} doc {doc_id}: splitserve {a['filtered_resps']!r} "
                         f"({metric} {score_a}), HF {b['filtered_resps']!r} "
                         f"({metric} {score_b})")
    return TaskComparison(task, metric, ours, theirs, lines, max_diff,
                          None if min_margin == float("inf") else min_margin)
