"""Scheduler configuration: parsed once in `__main__` into frozen objects and passed down;
a replica's engine gets an `EngineConfig` from membership."""

from dataclasses import dataclass

from services.kv_store_wire import KvSlice


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching policy of one replica's scheduler."""

    max_num_seqs: int = 256               # requests running at once
    max_num_batched_tokens: int = 2048    # tokens computed per step (the token budget)
    chunked_prefill: bool = True          # off: a prompt is scheduled whole or not at all
    long_prefill_token_threshold: int = 0  # >0: cap one request's prefill chunk per step
    prefix_caching: bool = True
    # A KV store hit's step computes the rest of the prompt as each layer's KV arrives (a
    # layer-wise load, never with pipeline stages); off: the hit loads, then is computed.
    layerwise_loads: bool = True
    block_size: int = 16                  # tokens per KV block
    max_model_len: int = 8192             # context length in tokens
    # The model's KV groups' windows (services.kv_groups `KvGroupLayout.windows`; 0 = full
    # attention): one block table per group per request.
    kv_group_windows: tuple[int, ...] = (0,)

    @property
    def token_budget(self) -> int:
        """Without chunked prefill any admissible prompt must fit one step (as in vLLM)."""
        if self.chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One replica's engine (scheduler_svc.engine), as membership builds it."""

    replica_id: int
    scheduler: SchedulerConfig
    num_kv_blocks: int                 # including the null block 0
    kv_timeout_s: float
    step_timeout_s: float
    ship_sampled_tokens: bool          # pipeline parallel: non-last ranks need sampled tokens
    max_batches_in_flight: int = 1     # the PP batch queue: pp_size keeps every stage busy
    async_scheduling: bool = False     # PP = 1: plan step N+1 while step N runs
    scheduler_epoch: int = 0           # this scheduler instance (kvcache_svc drops older pools)
    # Every rank's part of the KV in kvcache_svc's store, in rank order; empty: no loads.
    store_slices: tuple[KvSlice, ...] = ()


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `python -m scheduler_svc` needs."""

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
                                          # first rank's preferred dtype (membership.py)
    tp_size: int = 1
    pp_size: int = 1
    num_kv_blocks: int | None = None      # override of the measured block count
    kv_timeout_s: float = 2.0             # plan-call timeout (a plan takes ~1 ms)
    step_timeout_s: float = 120.0         # a step that takes longer means the worker is lost
    heartbeat_timeout_s: float = 3.0      # workers beat every second
    replica_wait_s: float = 60.0          # how long a request may wait for a ready replica
    route_tokens_per_request: float = 64.0  # routing: one live request weighs this many
                                            # cached prefix tokens (see Router.route)
    metrics_port: int | None = 50056      # Prometheus /metrics over HTTP (None: off)
    max_queue_len: int = 4096             # waiting requests before RESOURCE_EXHAUSTED
    stream_interval: int = 1              # tokens per client stream message (OutputStream)
    max_batches_in_flight: int = 0        # PP batch queue depth; 0 = pp_size
    async_scheduling: bool = False        # PP = 1: plan the next step while one runs
    max_prompt_bytes: int | None = None   # text prompt limit in UTF-8 bytes; None = derived
    chat_template: str | None = None      # --chat-template's value (a file or a template);
                                          # None = the model's own
