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
"""

from dataclasses import dataclass

import torch

from services.wire import MAX_TOP_LOGPROBS, SamplingSpec
from worker_svc.attention import build_attention_metadata, metadata_to
from worker_svc.kv_cache import allocate_kv_caches, bytes_per_block
from worker_svc.sampler import sample

GIB = 1 << 30
GPU_MARGIN_BYTES = 512 << 20      # CUDA graphs' pool, allocator fragmentation
CPU_MARGIN_BYTES = 1 << 30        # the process's own growth, the page cache's due
# The sampler's worst case per logit (float32 logits, scaled copy, probabilities, top-k and
# full-sort values with int64 indices, float64 CDF, log-softmax): measured 34 bytes above the
# logits on a CPU (256 rows x 49152, `worst_case_sampling`), rounded up.
SAMPLER_BYTES_PER_LOGIT = 40


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


def worst_case_sampling(logits: torch.Tensor) -> None:
    """Samples every row of `logits` ([rows, vocab]) the most memory-hungry way a request
    can ask for: temperature, top-k, a top-p nucleus wider than the sampler's candidates
    (equal logits: the whole vocabulary is sorted), and the most logprobs."""
    vocab = logits.shape[-1]
    spec = SamplingSpec(temperature=1.0, top_p=0.99, top_k=vocab - 1, seed=None,
                        num_logprobs=MAX_TOP_LOGPROBS)
    rows = logits.shape[0]
    sample(logits.float().fill_(0.0), [spec] * rows, [None] * rows)


def measure_kv_budget(runner: "ModelRunner", block_size: int,  # noqa: F821
                      max_num_batched_tokens: int, max_num_seqs: int,
                      cpu_cap_bytes: int | None, gpu_memory_utilization: float = 0.9
                      ) -> KvBudget:
    """`runner`'s KV budget (worker_svc.runner.ModelRunner, weights loaded): on a GPU after a
    profiling forward of the largest step; on a CPU from the host's available memory, capped
    at `cpu_cap_bytes`."""
    cfg, shard = runner.config, runner.model.shard
    rows = max(1, min(max_num_seqs, max_num_batched_tokens))
    if runner.device.type == "cpu":
        qkv = (shard.num_heads + 2 * shard.num_kv_heads) * cfg.head_dim
        inter = shard.intermediate[1] - shard.intermediate[0]
        peak = estimate_activation_bytes(max_num_batched_tokens,
                                         rows if runner.is_last_stage else 0,
                                         cfg.hidden_size, qkv, inter, cfg.vocab_size,
                                         torch.empty((), dtype=runner.dtype).element_size())
        return cpu_budget(host_available_bytes(), runner.weight_bytes, peak, cpu_cap_bytes)
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(runner.device)    # the weights and tables
    torch.cuda.reset_peak_memory_stats(runner.device)
    scratch = _profile_forward(runner, max_num_batched_tokens, rows, block_size)
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    other = max(0, (total - free) - torch.cuda.memory_reserved(runner.device))
    return gpu_budget(str(runner.device), total, gpu_memory_utilization, before, max(0, peak),
                      other)


def _profile_forward(runner: "ModelRunner", num_tokens: int, num_rows: int,  # noqa: F821
                     block_size: int) -> int:
    """One forward of `num_tokens` tokens over `num_rows` new requests (logits for each, and
    the sampler's worst case on them), on a scratch KV cache; returns the scratch cache's
    bytes."""
    lens = [num_tokens // num_rows + (1 if i < num_tokens % num_rows else 0)
            for i in range(num_rows)]
    lens.sort()                              # one-token queries first
    tables, next_block = [], 1
    for n in lens:
        need = -(-n // block_size)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    specs = runner.kv_layer_specs(block_size)
    caches = allocate_kv_caches(specs, next_block, runner.device)
    with torch.inference_mode():
        meta = metadata_to(build_attention_metadata(
            lens, [0] * num_rows, tables, block_size, next_block,
            torch_path=runner.model.kernels.attention is None), runner.device)
        hidden = residual = ids = None
        if runner.model.is_first_stage:
            ids = torch.zeros(num_tokens, dtype=torch.int64, device=runner.device)
        else:
            hidden = torch.zeros(num_tokens, runner.config.hidden_size, dtype=runner.dtype,
                                 device=runner.device)
            residual = torch.zeros_like(hidden)
        hidden, residual = runner.model.forward(ids, hidden, residual, meta.positions, meta,
                                                caches)
        if runner.is_last_stage:
            last = torch.cumsum(torch.tensor(lens, device=runner.device), 0) - 1
            logits = runner.model.compute_logits(hidden.index_select(0, last),
                                                 residual.index_select(0, last))
            worst_case_sampling(logits)
    del caches
    return bytes_per_block(specs) * next_block
