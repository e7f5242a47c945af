"""bench/client_reports.py: guidellm's JSON report read into the printed figures and failures,
lm-eval's results and samples read back, and two lm-eval runs compared per document."""

import json
from pathlib import Path
from typing import Any

import pytest

from bench.client_reports import (
    compare_task,
    guidellm_failures,
    guidellm_runs,
    lm_eval_samples,
    lm_eval_scores,
    replay_body,
)


def guidellm_bench(profile: str, ok: int, errored: int, out_tokens: float, duration: float,
                   error_bodies: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """A benchmark entry shaped as guidellm 0.8.1 writes it (only the keys we read)."""
    return {
        "config": {"strategy": {"type_": profile}},
        "duration": duration,
        "metrics": {
            "request_totals": {"successful": ok, "errored": errored, "incomplete": 0,
                               "total": ok + errored},
            "output_token_count": {"successful": {"total_sum": out_tokens}},
            "time_to_first_token_ms": {"successful": {"median": 120.5}},
            "inter_token_latency_ms": {"successful": {"median": 9.25}},
        },
        "requests": {"errored": [
            {"request_args": json.dumps({"body": body}),
             "info": {"error": "Client error '400 Bad Request'"}} for body in error_bodies]},
    }


def test_guidellm_runs_reads_each_profile() -> None:
    report = {"benchmarks": [guidellm_bench("synchronous", 4, 0, 128.0, 8.0),
                             guidellm_bench("concurrent", 8, 0, 256.0, 4.0)]}
    runs = guidellm_runs(report)
    assert [r.profile for r in runs] == ["synchronous", "concurrent"]
    assert runs[0].output_tok_s == pytest.approx(16.0)
    assert runs[1].output_tok_s == pytest.approx(64.0)
    assert runs[0].ttft_p50_ms == 120.5 and runs[0].itl_p50_ms == 9.25
    assert guidellm_failures(runs, expected=4) == [
        "guidellm concurrent: 8 of 4 completed, 0 errored, 0 incomplete"]
    fallback = replay_body(report, "m", 7)     # nothing kept: guidellm 0.8.1's own shape
    assert fallback["model"] == "m" and fallback["max_tokens"] == 7
    assert fallback["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_guidellm_errors_fail_and_keep_the_body() -> None:
    body = {"prompt": "x", "stream_options": {"continuous_usage_stats": True}}
    report = {"benchmarks": [guidellm_bench("synchronous", 3, 1, 96.0, 6.0, (body,))]}
    runs = guidellm_runs(report)
    assert runs[0].errors == ["Client error '400 Bad Request'"]
    (failure,) = guidellm_failures(runs, expected=4)
    assert "3 of 4 completed, 1 errored" in failure and "400 Bad Request" in failure
    assert replay_body(report, "m", 7) == body


def write_lm_eval(out: Path, scores: dict[str, tuple[str, float]],
                  samples: dict[str, list[dict[str, Any]]]) -> Path:
    """An lm-eval --output_path as 0.4.13 lays it out (a directory per model)."""
    run = out / "model__name"
    run.mkdir(parents=True)
    results = {task: {"alias": task, f"{m},none": v, f"{m}_stderr,none": 0.1}
               for task, (m, v) in scores.items()}
    (run / "results_2026-01-01T00-00-00.json").write_text(json.dumps({"results": results}))
    for task, rows in samples.items():
        (run / f"samples_{task}_2026-01-01T00-00-00.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    return out


def mc(doc_id: int, lls: list[float], label: int) -> dict[str, Any]:
    pick = lls.index(max(lls))
    return {"doc_id": doc_id, "filtered_resps": [[str(x), "False"] for x in lls],
            "acc": float(pick == label)}


def gen(doc_id: int, text: str, answer: str) -> dict[str, Any]:
    return {"doc_id": doc_id, "filtered_resps": [text],
            "exact_match": float(text.strip().lower() == answer.lower())}


def test_lm_eval_scores_and_samples_read_back(tmp_path: Path) -> None:
    out = write_lm_eval(tmp_path, {"t_mc": ("acc", 0.5), "t_gen": ("exact_match", 1.0)},
                        {"t_mc": [mc(0, [-1.0, -2.0], 0), mc(1, [-1.0, -2.0], 1)]})
    assert lm_eval_scores(out) == {"t_mc": ("acc", 0.5), "t_gen": ("exact_match", 1.0)}
    assert sorted(lm_eval_samples(out, "t_mc")) == [0, 1]
    with pytest.raises(FileNotFoundError, match="samples_t_gen"):
        lm_eval_samples(out, "t_gen")
    with pytest.raises(FileNotFoundError, match="results_"):
        lm_eval_scores(tmp_path / "model__name" / "nothing-here")


def test_equal_runs_compare_equal() -> None:
    ours = {0: mc(0, [-1.00001, -3.0, -2.0], 0), 1: mc(1, [-2.0, -1.5, -4.0], 0)}
    theirs = {0: mc(0, [-1.0, -3.0, -2.0], 0), 1: mc(1, [-2.0, -1.5, -4.0], 0)}
    c = compare_task("t_mc", "acc", 0.5, 0.5, ours, theirs)
    assert c.equal and c.disagreements == []
    assert c.max_abs_ll_diff == pytest.approx(1e-5)
    assert c.min_margin == pytest.approx(0.5)


def test_a_flipped_choice_is_named_with_its_margin() -> None:
    ours = {0: mc(0, [-1.0, -0.99], 0)}
    theirs = {0: mc(0, [-1.0, -1.01], 0)}
    c = compare_task("t_mc", "acc", 0.0, 1.0, ours, theirs)
    assert not c.equal
    (line,) = c.disagreements
    assert "doc 0: splitserve picks 1" in line and "HF picks 0" in line
    assert "margin 1.00e-02" in line


def test_a_different_generation_fails_even_with_equal_scores() -> None:
    ours = {0: gen(0, " Rome", "Paris"), 1: gen(1, " blue", "blue")}
    theirs = {0: gen(0, " Milan", "Paris"), 1: gen(1, " blue", "blue")}
    c = compare_task("t_gen", "exact_match", 0.5, 0.5, ours, theirs)
    assert not c.equal and c.min_margin is None
    (line,) = c.disagreements
    assert "doc 0" in line and "Rome" in line and "Milan" in line


def test_different_documents_are_refused() -> None:
    with pytest.raises(ValueError, match="different documents"):
        compare_task("t_gen", "exact_match", 1.0, 1.0, {0: gen(0, "a", "a")},
                     {1: gen(1, "a", "a")})
