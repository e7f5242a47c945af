"""The largest step a worker will run, run once on a scratch KV cache: what a GPU worker
measures its activation peak on before it sizes its KV cache.

`ModelRunner.measure_kv_budget` (worker_svc.runner) hands `profile_forward`, bound to its
model and KV layout, to worker_svc.memory_budget, which measures the device's memory around
it. The step: `num_tokens` tokens over `num_rows` new requests (lengths as even as they
split, one-token queries first), logits for every row, then the sampler's worst case on them
(temperature, top-k, a top-p nucleus past the sampler's candidates, so the whole vocabulary is
sorted, and the most logprobs).
"""

import torch

from services.wire import MAX_TOP_LOGPROBS, SamplingSpec
from worker_svc.attention import build_attention_metadata, metadata_to
from worker_svc.kv_cache import KvLayerSpec, allocate_kv_caches, bytes_per_block, layer_caches
from worker_svc.model.llama import LlamaModel
from worker_svc.penalties import TokenHistory
from worker_svc.prompt_logprobs import ROWS_PER_SLICE as PROMPT_LOGPROB_ROWS
from worker_svc.sampler import sample


def worst_case_sampling(logits: torch.Tensor) -> None:
    """Samples every row of `logits` ([rows, vocab]) the most memory-hungry way a request
    can ask for: temperature, top-k, a top-p nucleus wider than the sampler's candidates
    (equal logits: the whole vocabulary is sorted), the most logprobs, min_p and every penalty
    (their [rows, vocab] token counts)."""
    vocab = logits.shape[-1]
    spec = SamplingSpec(temperature=1.0, top_p=0.99, top_k=vocab - 1, seed=None,
                        num_logprobs=MAX_TOP_LOGPROBS, min_p=1e-9, presence_penalty=0.5,
                        frequency_penalty=0.5, repetition_penalty=1.1)
    rows = logits.shape[0]
    history = TokenHistory([0, 1], 1)
    sample(logits.float().fill_(0.0), [spec] * rows, [None] * rows,
           histories=[history] * rows)


def profile_forward(model: LlamaModel, specs: list[KvLayerSpec], num_tokens: int,
                    num_rows: int, block_size: int,
                    positions: tuple[int, ...] | None = None) -> int:
    """One forward of `num_tokens` tokens over `num_rows` new requests through `model` (logits
    for each, the sampler's worst case on them and a slice of prompt logprobs, on the last
    stage), on a scratch KV cache
    of `specs`' layout: one tensor per KV group position in `positions` (None: one per layer),
    every KV group on the same block tables; returns the scratch cache's bytes."""
    lens = [num_tokens // num_rows + (1 if i < num_tokens % num_rows else 0)
            for i in range(num_rows)]
    lens.sort()                              # one-token queries first
    tables, next_block = [], 1
    for n in lens:
        need = -(-n // block_size)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    device = model.device
    caches = allocate_kv_caches(specs, next_block, device)
    if positions is not None:
        caches = layer_caches(caches, positions, model.layer_positions)
    with torch.inference_mode():
        meta = metadata_to(build_attention_metadata(
            lens, [0] * num_rows, tables, block_size, next_block,
            torch_path=model.kernels.attention is None), device)
        hidden = residual = ids = None
        if model.is_first_stage:
            ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        else:
            hidden = torch.zeros(num_tokens, model.config.hidden_size, dtype=model.dtype,
                                 device=device)
            residual = torch.zeros_like(hidden)
        hidden, residual = model.forward(ids, hidden, residual, meta.positions, meta, caches)
        if model.is_last_stage:
            last = torch.cumsum(torch.tensor(lens, device=device), 0) - 1
            logits = model.compute_logits(hidden.index_select(0, last),
                                          residual.index_select(0, last))
            worst_case_sampling(logits)
            # Prompt logprobs take logits for up to a slice of rows at once.
            rows = torch.arange(min(PROMPT_LOGPROB_ROWS, num_tokens), device=device)
            model.compute_logits(hidden.index_select(0, rows), residual.index_select(0, rows)
                                 ).float().log_softmax(dim=-1).topk(MAX_TOP_LOGPROBS, dim=-1)
    del caches
    return bytes_per_block(specs) * next_block
