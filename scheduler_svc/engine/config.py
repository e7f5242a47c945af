"""The engine core's configuration: batching policy (`SchedulerConfig`) and one replica's
engine (`EngineConfig`). The cluster derives both once (scheduler_svc.cluster) and hands an
engine core its `EngineConfig` when it starts the process (scheduler_svc.engine.launch)."""

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
    # The waiting queue's order (scheduler_svc.engine.fair_queue): "fair" admits clients in
    # turn, "fcfs" in order of arrival.
    scheduling_policy: str = "fair"

    @property
    def token_budget(self) -> int:
        """Without chunked prefill any admissible prompt must fit one step (as in vLLM)."""
        if self.chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One replica's engine core (scheduler_svc.engine.core), as the cluster builds it."""

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
    # The model's end-of-sequence token ids (the engine's stop checks).
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0                # the model's logits width (grammar masks)
