#!/usr/bin/env bash
# Creates or refreshes .venv-clients at the repository root: the load generators and
# evaluation harness vLLM users point at an OpenAI-compatible server (pyproject's `clients`
# extra, pinned there), which bench/http_clients.py runs against the live services. Kept apart
# from .venv because lm-eval and guidellm pull in datasets, scikit-learn and their own
# transformers; vLLM's own `vllm bench serve` client lives in .venv-vllm (bench/vllm_env.sh).
#
#     bash bench/clients_env.sh        # idempotent: re-installs only when this file changed
#
# lm-eval requires torch: the machine's local CPU wheel goes in first, so that the resolver
# never reaches for a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-clients"
STAMP="$VENV/.clients-installed"
TORCH="torch==2.13.0"
CLIENTS=("guidellm==0.8.1" "lm-eval[api,hf]==0.4.13" "openai==3.57.0")  # lm-eval: local-completions, hf
WANT="$(sha256sum "$ROOT/bench/clients_env.sh" | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  PY="${PYTHON:-python3.11}"
  command -v "$PY" >/dev/null || PY=python3
  "$PY" -m venv "$VENV"
fi
echo "clients_env: installing ${CLIENTS[*]} into $VENV (first run takes a few minutes)" >&2
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "$TORCH"
"${PIP[@]}" "${CLIENTS[@]}" "$TORCH"
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md

import torch

assert not torch.version.cuda, "a CUDA build of torch was installed"
for name in ("guidellm", "lm_eval", "openai"):
    print(f"clients_env: {name} {md.version(name.replace('_', '-'))}")
PYEOF
echo "$WANT" > "$STAMP"
