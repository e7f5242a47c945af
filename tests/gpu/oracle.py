"""HF transformers on the GPU as the oracle for the GPU tests: the same random-weight directory
the services load, greedy, one token at a time with its cache, recording each step's top-1/top-2
logit margin for the near-tie rule (tests/e2e/harness.py's TIE_MARGIN).

fp32 with TF32 off and eager attention: the reference must be the most exact computation at
hand, so that a mismatch beyond a near-tie is the services' error and not the oracle's."""

from collections.abc import Sequence
from pathlib import Path

import torch


def disable_tf32() -> None:
    """fp32 matmuls and convolutions in full fp32 in this process (TF32 keeps 10 mantissa
    bits, enough to flip greedy tokens at margins far above TIE_MARGIN)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class CudaOracle:
    """Greedy reference on `device`; results are cached per (prompt, max_tokens)."""

    def __init__(self, model_dir: Path, device: str = "cuda") -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        if self.device.type == "cuda":
            disable_tf32()
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="eager").to(self.device)
        self.model.eval()
        self._cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """(tokens, top-1 minus top-2 logit at each step)."""
        key = (tuple(prompt), max_tokens)
        if key in self._cache:
            return self._cache[key]
        ids = torch.tensor([list(prompt)], device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        tokens: list[int] = []
        margins: list[float] = []
        for _ in range(max_tokens):
            top2 = torch.topk(out.logits[0, -1].float(), 2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            out = self.model(input_ids=top2.indices[:1].view(1, 1),
                             past_key_values=out.past_key_values, use_cache=True)
        self._cache[key] = (tokens, margins)
        return tokens, margins

    @torch.inference_mode()
    def next_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The fp32 logits of the token after `token_ids`, on the CPU. [vocab_size]"""
        ids = torch.tensor([list(token_ids)], device=self.device)
        return self.model(input_ids=ids).logits[0, -1].float().cpu()
