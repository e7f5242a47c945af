"""HF transformers on the GPU as the oracle for the GPU tests: the same random-weight directory
the services load, greedy, one token at a time with its cache, recording each step's top-1/top-2
logit margin for the near-tie rule (tests/e2e/harness.py's TIE_MARGIN).

fp32 with TF32 off and eager attention: the reference must be the most exact computation at
hand, so that a mismatch beyond a near-tie is the services' error and not the oracle's."""

from collections.abc import Sequence
from pathlib import Path

import torch

from tests.e2e.harness import GreedyOracle


def disable_tf32() -> None:
    """fp32 matmuls and convolutions in full fp32 in this process (TF32 keeps 10 mantissa
    bits, enough to flip greedy tokens at margins far above TIE_MARGIN)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class CudaOracle(GreedyOracle):
    """The greedy reference (tests/e2e/harness.py) on `device`, from an HF directory."""

    def __init__(self, model_dir: Path, device: str = "cuda") -> None:
        from transformers import AutoModelForCausalLM

        if torch.device(device).type == "cuda":
            disable_tf32()
        super().__init__(AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="eager").to(device),
            torch.device(device))

    @torch.inference_mode()
    def next_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The fp32 logits of the token after `token_ids`, on the CPU. [vocab_size]"""
        ids = torch.tensor([list(token_ids)], device=self.device)
        return self.model(input_ids=ids).logits[0, -1].float().cpu()
