"""The clients vLLM users already run, unchanged, against splitserve's HTTP front end (issue
38, point 3): guidellm's load generator and lm-evaluation-harness's `local-completions`
model, in one invocation against one live cluster; lm-eval's scores checked against HF
transformers (lm-eval's `hf` model) on the same weights in float32.

    bash bench/clients_env.sh     # once: .venv-clients (pyproject's `clients` extra)
    .venv/bin/python bench/http_clients.py [--skip-guidellm] [--skip-lm-eval]

The model is SmolLM2-135M-Instruct: splitserve serves the GGUF in float32, the clients'
tokenizer and the HF oracle load the same weights saved once as an HF directory
(bench/vllm_peer.py). Nothing is downloaded: the clients run with the hubs offline.

guidellm 0.8.1: a synchronous profile, then a concurrent one (`--concurrency` streams), each
`--requests` synthetic prompts of `--prompt-tokens` tokens, `--output-tokens` new tokens each
(ignore_eos), streamed on /v1/completions. Printed per profile: requests completed and
errored, output tok/s (tokens / the profile's duration), TTFT and ITL p50 as guidellm
measures them. Any errored request fails the run; a body as guidellm sends it is then
replayed, to print the server's own refusal (guidellm records only the status line).

lm-eval 0.4.13: the two tasks in bench/lm_eval_tasks/ (multiple choice scored by
loglikelihood, which `local-completions` asks of the server with echo + logprobs; greedy
one-word generation until a newline), first through splitserve, then, with the cluster
stopped, through `hf` on the HF directory (float32, batch size 1). Printed: both scores side
by side and each document whose outcome differs; the run fails when any does.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import write_result  # noqa: E402
from client_reports import (  # noqa: E402
    TaskComparison,
    compare_task,
    guidellm_failures,
    guidellm_runs,
    lm_eval_samples,
    lm_eval_scores,
    replay_body,
)
from http_serving import READY_TIMEOUT_S, wait_http  # noqa: E402
from splitserve_runs import free_port  # noqa: E402
from throughput import cpu_info, cpu_line  # noqa: E402
from vllm_peer import save_hf_dir  # noqa: E402

from services.launcher import ClusterSpec, ServiceProcesses  # noqa: E402
from services.model_config import default_model_path  # noqa: E402

CLIENTS_BIN = ROOT / ".venv-clients" / "bin"
TASKS_DIR = ROOT / "bench" / "lm_eval_tasks"
TASKS = ("splitserve_multiple_choice", "splitserve_generation")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def run_logged(cmd: list[str], log: Path) -> int:
    """Runs a client with its output to `log`; its exit status."""
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **OFFLINE}).returncode


def log_tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def refusal(base_url: str, body: dict[str, object]) -> str:
    """The server's answer to `body` on /v1/completions, replayed without streaming the
    reply's chunks (the status and error body are what matter)."""
    req = urllib.request.Request(f"{base_url}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return f"{resp.status} (accepted on replay)"
    except urllib.error.HTTPError as err:
        return f"{err.code} {err.read().decode(errors='replace')}"


def guidellm(base_url: str, model: str, hf_dir: Path, a: argparse.Namespace,
             out_dir: Path) -> tuple[list[dict[str, object]], list[str]]:
    """The synchronous and the concurrent profile; their figures, and what failed."""
    profiles = {"synchronous": "kind=synchronous",
                "concurrent": f"kind=concurrent,streams={a.concurrency}"}
    figures: list[dict[str, object]] = []
    failures: list[str] = []
    for name, profile in profiles.items():
        report_path, log = out_dir / f"guidellm-{name}.json", out_dir / f"guidellm-{name}.log"
        cmd = [str(CLIENTS_BIN / "guidellm"), "run",
               "--backend", f"kind=openai_http,target={base_url},model={model},"
                            "request_format=/v1/completions,stream=true",
               "--profile", profile,
               "--constraint", f"kind=max_requests,count={a.requests}",
               "--tokenizer", f"kind=huggingface_auto,model={hf_dir}",
               "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},"
                         f"output_tokens={a.output_tokens}",
               "--output", f"kind=json,path={report_path}",
               "--disable-console-interactive"]
        code = run_logged(cmd, log)
        if code != 0 or not report_path.is_file():
            failures.append(f"guidellm {name}: exit {code}, no report; {log}:\n{log_tail(log)}")
            continue
        report = json.loads(report_path.read_text())
        runs = guidellm_runs(report)
        figures += [vars(r) for r in runs]
        for r in runs:
            print(f"guidellm {r.profile:<12} completed {r.completed:>3}  errored {r.errored}  "
                  f"out tok/s {r.output_tok_s:7.1f}  TTFT p50 {r.ttft_p50_ms:8.1f} ms  "
                  f"ITL p50 {r.itl_p50_ms:7.1f} ms", flush=True)
        failures += guidellm_failures(runs, a.requests)
        if any(r.errored for r in runs):
            body = replay_body(report, model, a.output_tokens)
            failures.append(f"guidellm {name}: the server's answer to {json.dumps(body)} "
                            f"replayed: {refusal(base_url, body)}")
    return figures, failures


def lm_eval(model_name: str, model_args: str, out_dir: Path, extra: list[str]) -> Path:
    """One lm-eval run of TASKS with per-document samples; its --output_path."""
    path = out_dir / f"lm-eval-{model_name}"
    log = out_dir / f"lm-eval-{model_name}.log"
    cmd = [str(CLIENTS_BIN / "lm_eval"), "run", "--model", model_name,
           "--model_args", model_args, "--tasks", *TASKS, "--include_path", str(TASKS_DIR),
           "--output_path", str(path), "--log_samples", *extra]
    if (code := run_logged(cmd, log)) != 0:
        raise RuntimeError(f"lm-eval {model_name}: exit {code}; {log}:\n{log_tail(log)}")
    return path


def compare_lm_eval(ours_dir: Path, hf_dir: Path) -> list[TaskComparison]:
    ours, theirs = lm_eval_scores(ours_dir), lm_eval_scores(hf_dir)
    return [compare_task(task, ours[task][0], ours[task][1], theirs[task][1],
                         lm_eval_samples(ours_dir, task), lm_eval_samples(hf_dir, task))
            for task in TASKS]


def print_comparison(comparisons: list[TaskComparison]) -> None:
    print(f"\n{'lm-eval task':<28}{'metric':<13}{'splitserve':>11}{'HF fp32':>9}  docs differ")
    for c in comparisons:
        print(f"{c.task:<28}{c.metric:<13}{c.ours:>11.4f}{c.theirs:>9.4f}  "
              f"{len(c.disagreements)}")
        if c.min_margin is not None:
            print(f"  loglikelihoods: max |splitserve - HF| {c.max_abs_ll_diff:.2e}, "
                  f"smallest HF best-vs-second margin {c.min_margin:.2e}")
        for line in c.disagreements:
            print(f"  {line}")


def start_cluster(out_dir: Path) -> tuple[ServiceProcesses, str]:
    """splitserve (`splitserve up`'s cluster with its HTTP front end) on the GGUF, float32."""
    http_port = free_port()
    spec = ClusterSpec(model=str(default_model_path()), port=free_port(),
                       control_port=free_port(), kv_plan_port=free_port(),
                       kv_admin_port=free_port(), kv_events_port=0, kv_store_port=0,
                       metrics_port=-1, http_port=http_port, dtype="float32",
                       log_level="warning")
    procs = ServiceProcesses(spec, out_dir / "splitserve-logs")
    procs.start()
    try:
        procs.wait_ready(READY_TIMEOUT_S)
    except BaseException:
        procs.stop()
        raise
    return procs, f"http://127.0.0.1:{http_port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-guidellm", action="store_true")
    p.add_argument("--skip-lm-eval", action="store_true")
    p.add_argument("--requests", type=int, default=8, help="guidellm requests per profile")
    p.add_argument("--concurrency", type=int, default=4, help="guidellm concurrent streams")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", help="result JSON (default bench/results/http-clients-<time>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so that `finally` stops the cluster it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cpu = cpu_info()
    print(cpu_line(cpu), flush=True)
    for tool in ("guidellm", "lm_eval"):
        if not (CLIENTS_BIN / tool).is_file():
            raise SystemExit(f"{CLIENTS_BIN / tool} missing: run `bash bench/clients_env.sh`")
    gguf = default_model_path()
    hf_dir = save_hf_dir(gguf, ROOT / "bench" / "results" / f"hf-{gguf.stem}")
    out_dir = Path(tempfile.mkdtemp(prefix="http-clients-"))
    print(f"logs and raw results in {out_dir}", flush=True)
    results: dict[str, object] = {"cpu": cpu, "args": vars(a)}
    failures: list[str] = []

    procs, base_url = start_cluster(out_dir)
    try:
        model = wait_http(base_url, out_dir / "splitserve-logs", READY_TIMEOUT_S)
        if not a.skip_guidellm:
            results["guidellm"], found = guidellm(base_url, model, hf_dir, a, out_dir)
            failures += found
        if not a.skip_lm_eval:
            ours = lm_eval("local-completions",
                           f"model={model},base_url={base_url}/v1/completions,"
                           f"tokenizer={hf_dir},tokenizer_backend=huggingface,"
                           "num_concurrent=4,max_retries=1", out_dir, [])
    finally:
        procs.stop()

    if not a.skip_lm_eval:
        # The oracle runs with the cluster stopped: the CPUs are its alone.
        oracle = lm_eval("hf", f"pretrained={hf_dir},dtype=float32", out_dir,
                         ["--batch_size", "1", "--device", "cpu"])
        comparisons = compare_lm_eval(ours, oracle)
        print_comparison(comparisons)
        results["lm_eval"] = [vars(c) for c in comparisons]
        failures += [f"lm-eval {c.task}: splitserve {c.ours} != HF {c.theirs} or "
                     f"{len(c.disagreements)} documents differ"
                     for c in comparisons if not c.equal]
    results["failures"] = failures
    write_result(results, a.out, "http-clients")
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
