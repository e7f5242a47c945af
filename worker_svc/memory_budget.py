"""How much memory a worker gives its KV cache, from what it measures after loading its shard.

On a GPU (as vLLM does): after the weights are loaded, one profiling forward at the largest
step the scheduler will send (`max_num_batched_tokens` tokens, logits for up to `max_num_seqs`
rows, then the sampler's worst case on them: temperature, top-k, a top-p nucleus past the
sampler's candidates, so the whole vocabulary is sorted, and the most logprobs) measures the
peak of activation memory. Then

    KV budget = total × gpu_memory_utilization − weights − peak activations − other − margin

where `other` is GPU memory outside torch's allocator (the CUDA context, cuBLAS workspaces,
other processes on the same GPU) and the margin covers CUDA graphs and fragmentation.

On a CPU the same accounting runs against the host's available memory (MemAvailable, read
after the weights are loaded, so they are already out of it), the activation peak is
estimated from the shapes instead of measured (host allocations have no peak counter), and
`--kv-cache-memory-gib` caps the result: a CPU worker shares its machine with the scheduler,
clients and other workers.

Every term is logged; the replica takes the smallest block count over its ranks.

Called by `ModelRunner.measure_kv_budget` (worker_svc.runner), which states what its shard
takes (`ShardFootprint`) and hands over its profiling forward (worker_svc.profile_step): this
module sees numbers and a callable, never the runner or its model.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

GIB = 1 << 30
GPU_MARGIN_BYTES = 512 << 20      # CUDA graphs' pool, allocator fragmentation
CPU_MARGIN_BYTES = 1 << 30        # the process's own growth, the page cache's due
# The sampler's worst case per logit (float32 logits, scaled copy, probabilities, top-k and
# full-sort values with int64 indices, float64 CDF, log-softmax): measured 34 bytes above the
# logits on a CPU (256 rows x 49152, worker_svc.profile_step's `worst_case_sampling`), rounded
# up.
SAMPLER_BYTES_PER_LOGIT = 40


@dataclass(frozen=True, slots=True)
class ShardFootprint:
    """What a loaded shard takes besides its KV cache, as its runner states it
    (`ModelRunner.footprint`): the budget's inputs."""

    device: torch.device
    weight_bytes: int          # the shard's weights, as loaded
    hidden_size: int
    qkv_width: int             # this rank's query, key and value columns
    intermediate_size: int     # this rank's slice of the MLP
    vocab_size: int            # logits per sampled row (the full vocabulary on every rank)
    itemsize: int              # bytes per activation element (the model's dtype)
    samples: bool              # the last stage: logits and the sampler come on top


@dataclass(frozen=True, slots=True)
class KvBudget:
    """The terms of one worker's KV-cache budget, in bytes."""

    device: str                  # "cpu" or "cuda:N"
    total: int                   # GPU: the card's memory; CPU: MemAvailable after loading
    utilization: float           # share of `total` the worker may use (GPU), 1.0 on CPU
    weights: int                 # this shard's weights (GPU: measured; CPU: already out)
    peak_activation: int         # the profiling pass's peak above the weights
    other: int                   # GPU memory outside torch's allocator; 0 on CPU
    margin: int
    cap: int | None = None       # CPU: --kv-cache-memory-gib

    @property
    def budget(self) -> int:
        if self.device == "cpu":
            free = self.total - self.peak_activation - self.margin
            return max(0, min(free, self.cap) if self.cap is not None else free)
        usable = int(self.total * self.utilization)
        return max(0, usable - self.weights - self.peak_activation - self.other - self.margin)

    def num_blocks(self, bytes_per_block: int) -> int:
        """Blocks (the null block included) that fit the budget."""
        return self.budget // bytes_per_block

    def describe(self) -> str:
        g = GIB
        if self.device == "cpu":
            cap = "none" if self.cap is None else f"{self.cap / g:.2f}"
            return (f"KV budget {self.budget / g:.2f} GiB = min(cap {cap}, available "
                    f"{self.total / g:.2f} - activations {self.peak_activation / g:.2f} "
                    f"(estimated) - margin {self.margin / g:.2f}); weights "
                    f"{self.weights / g:.2f} GiB")
        return (f"KV budget {self.budget / g:.2f} GiB = {self.total / g:.2f} total x "
                f"{self.utilization:.2f} - weights {self.weights / g:.2f} - peak activations "
                f"{self.peak_activation / g:.2f} - other {self.other / g:.2f} - margin "
                f"{self.margin / g:.2f}")


def cpu_budget(available: int, weights: int, peak_activation: int, cap: int | None,
               margin: int = CPU_MARGIN_BYTES) -> KvBudget:
    return KvBudget("cpu", available, 1.0, weights, peak_activation, 0, margin, cap)


def gpu_budget(device: str, total: int, utilization: float, weights: int, peak_activation: int,
               other: int, margin: int = GPU_MARGIN_BYTES) -> KvBudget:
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return KvBudget(device, total, utilization, weights, peak_activation, other, margin)


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable, in bytes (what the kernel could hand out without swapping)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable in {meminfo}")


def estimate_activation_bytes(num_tokens: int, num_logit_rows: int, hidden_size: int,
                              qkv_width: int, intermediate_size: int, vocab_size: int,
                              itemsize: int) -> int:
    """A CPU step's largest live activations: one layer's (residual, normed input, qkv,
    attention output, gate/up, SiLU product, two hidden outputs) for every token, plus the
    sampled rows' logits and the sampler's worst case on them."""
    per_token = (4 * hidden_size + 2 * qkv_width + 3 * intermediate_size) * itemsize
    return num_tokens * per_token + num_logit_rows * vocab_size * SAMPLER_BYTES_PER_LOGIT


def measure_kv_budget(footprint: ShardFootprint, max_num_batched_tokens: int,
                      max_num_seqs: int, cpu_cap_bytes: int | None,
                      gpu_memory_utilization: float, profile: Callable[[int, int], int]
                      ) -> KvBudget:
    """The KV budget of a shard that takes `footprint`: on a GPU measured around
    `profile(num_tokens, num_rows)`, which runs the largest step once on a scratch KV cache
    and returns that cache's bytes; on a CPU from the host's available memory and an
    estimate of the same step, capped at `cpu_cap_bytes`."""
    rows = max(1, min(max_num_seqs, max_num_batched_tokens))
    if footprint.device.type == "cpu":
        peak = estimate_activation_bytes(max_num_batched_tokens, rows if footprint.samples else 0,
                                         footprint.hidden_size, footprint.qkv_width,
                                         footprint.intermediate_size, footprint.vocab_size,
                                         footprint.itemsize)
        return cpu_budget(host_available_bytes(), footprint.weight_bytes, peak, cpu_cap_bytes)
    device = footprint.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)    # the weights and tables
    torch.cuda.reset_peak_memory_stats(device)
    scratch = profile(max_num_batched_tokens, rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return gpu_budget(str(device), total, gpu_memory_utilization, before, max(0, peak), other)
