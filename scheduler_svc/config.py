"""The scheduler service's settings shared by its cluster process and its front ends: parsed
once in `__main__` into a frozen `ServerConfig` and passed down (to a front-end process on its
stdin, scheduler_svc.frontend.launch). The engine core's own are in
scheduler_svc.engine.config."""

from dataclasses import dataclass, field

# What a request carries besides its prompt (id, stop strings, chat framing), for the gRPC
# receive bound of the client port.
REQUEST_OVERHEAD_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `python -m scheduler_svc` needs beyond the batching policy."""

    model_path: str
    model_name: str                       # public name (--served-model-name); "" = the model's
    host: str = "127.0.0.1"
    port: int = 50051                     # public gRPC (Generation, health, reflection)
    control_host: str = "127.0.0.1"       # internal gRPC: worker registration, heartbeats
    control_port: int = 50052
    cluster_token: str = ""               # what every member presents (services.cluster_token)
    advertise_host: str = "127.0.0.1"     # how workers reach this host's ZMQ sockets
    kvcache_address: str = "tcp://127.0.0.1:50053"  # kvcache_svc plan socket
    dtype: str = "auto"                   # "float32", "bfloat16", or "auto": per replica, its
                                          # first rank's preferred dtype (cluster.membership)
    kv_cache_dtype: str = "auto"          # --kv-cache-dtype (worker_svc.kernels.kv_quant)
    quantization: str = ""                # --quantization: "" or "int8", every replica
    tp_size: int = 1
    pp_size: int = 1
    num_kv_blocks: int | None = None      # override of the measured block count
    kv_timeout_s: float = 2.0             # plan-call timeout (a plan takes ~1 ms)
    step_timeout_s: float = 120.0         # a step that takes longer means the worker is lost
    heartbeat_timeout_s: float = 3.0      # workers beat every second
    replica_wait_s: float = 60.0          # how long a request may wait for a ready replica
    route_tokens_per_request: float = 64.0  # routing: one live request weighs this many
                                            # cached prefix tokens (see frontend.router)
    metrics_port: int | None = 50056      # Prometheus /metrics over HTTP (None: off)
    max_queue_len: int = 4096             # live requests per front end before RESOURCE_EXHAUSTED
    # Calls a front end serves at once on the client port (services.grpc_server.CallLimit):
    # twice its live requests (max_queue_len), so that every request it may hold and as many
    # short calls (tokenize, detokenize, model card) fit; past it, RESOURCE_EXHAUSTED.
    max_concurrent_calls: int = 8192
    stream_interval: int = 1              # tokens per client stream message (OutputStream)
    max_grammar_compile_s: float = 5.0    # a request's grammar compile budget, seconds
                                          # (frontend.grammar_pool; --max-grammar-compile-s)
    max_batches_in_flight: int = 0        # PP batch queue depth; 0 = pp_size
    async_scheduling: bool = False        # PP = 1: plan the next step while one runs
    max_prompt_bytes: int | None = None   # text prompt limit in UTF-8 bytes; None = derived
    chat_template: str | None = None      # --chat-template's value (a file or a template);
                                          # None = the model's own
    tokenizer_path: str | None = None     # --tokenizer: HF dir or GGUF; None = the model's
    generation_config: str = "auto"       # --generation-config: auto, vllm or a directory
    num_frontends: int = 1                # front-end processes sharing the client port
    # The client port's API keys (services.api_keys; empty: open) and TLS files (None: none).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    seed: int | None = None               # --seed: seeds unseeded random requests' seeds
