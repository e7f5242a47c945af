"""HF transformers on a GPU as the peer of `bench/throughput.py --device cuda`: the random
model's directory, the same prompts and figures as splitserve, in two forms.

- eager: `generate` with its default dynamic cache, op by op (sdpa attention).
- static + compile: `generate` with `cache_implementation="static"`, which makes transformers
  compile the decode step's forward with torch.compile (CompileConfig, mode "reduce-overhead":
  inductor kernels replayed as CUDA graphs). The prefill stays eager. This is transformers 5's
  own documented route to compiled generation, so the peer is HF at its fastest without
  hand-written code of ours.

Prompts are tokenized with the model directory's tokenizer.json through `tokenizers`, the
library the scheduler tokenizes with, and left-padded here: no transformers tokenizer class is
involved, so the peer behaves the same under every transformers version. Greedy, exactly
`max_tokens` new tokens (min_new_tokens keeps EOS from ending a row early).

Figures, as HfBaseline in throughput.py: single TTFT = a 1-token generate of the single
prompt; single decode tokens/s = (tokens - 1) / (full generate - TTFT); batch = every prompt
in one generate, wall time, prefill included. Each timed generate follows an identical untimed
one, so compilation and CUDA-graph recording fall outside the clock. Clocks stop after
torch.cuda.synchronize().
"""

import gc
import time
from pathlib import Path

import torch
from bench_io import time_peer_round

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HfCudaPeer:
    """One model loaded on `device`; `run()` times one round, `close()` frees the GPU."""

    def __init__(self, model_dir: Path, dtype: str, compiled: bool,
                 device: str = "cuda") -> None:
        from tokenizers import Tokenizer
        from transformers import AutoModelForCausalLM, CompileConfig

        self.device = torch.device(device)
        self.compiled = compiled
        # One object for every call: transformers recompiles when the config it is handed
        # differs from the last one.
        self.compile_config = CompileConfig(mode="reduce-overhead") if compiled else None
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=DTYPES[dtype], attn_implementation="sdpa").to(self.device)
        self.model.eval()
        # Any id works for padding: the attention mask hides it.
        eos = self.model.config.eos_token_id
        self.pad_id = int((eos[0] if isinstance(eos, list) else eos) or 0)

    def _inputs(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids and attention mask. [num_texts, longest]"""
        rows = [enc.ids for enc in self.tokenizer.encode_batch(texts)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _generate(self, texts: list[str], num_tokens: int) -> tuple[int, float]:
        """(new tokens over all rows, seconds). An identical untimed call goes first, every
        time: the timed call then finds transformers' static cache of this shape (it keeps
        the last one, and reallocates when the shape changes) and the CUDA graphs recorded
        on its addresses, instead of re-recording them on the clock."""
        ids, mask = self._inputs(texts)
        self._call(ids, mask, num_tokens)
        self._sync()
        start = time.perf_counter()
        out = self._call(ids, mask, num_tokens)
        self._sync()
        elapsed = time.perf_counter() - start
        return (out.shape[1] - ids.shape[1]) * ids.shape[0], elapsed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _call(self, ids: torch.Tensor, mask: torch.Tensor, num_tokens: int) -> torch.Tensor:
        kwargs: dict[str, object] = {}
        if self.compile_config is not None:
            kwargs = {"cache_implementation": "static", "compile_config": self.compile_config}
        return self.model.generate(input_ids=ids, attention_mask=mask,
                                   max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                   do_sample=False, pad_token_id=self.pad_id, **kwargs)

    def run(self, prompts: list[str], single: str, max_tokens: int) -> dict[str, float]:
        return time_peer_round(self._generate, prompts, single, max_tokens)

    def compile_happened(self) -> bool | None:
        """Whether transformers compiled the decode step (it does only when its criteria
        hold: a CUDA device, a compilable cache), read from its `_compiled_call` attribute;
        None for the eager peer. A "compiled" row that ran eagerly would mislead."""
        return hasattr(self.model, "_compiled_call") if self.compiled else None

    def close(self) -> None:
        """Drops the model, its compiled graphs and their CUDA-graph memory pools."""
        del self.model
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
