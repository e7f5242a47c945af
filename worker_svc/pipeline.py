"""Pipeline-parallel links between the stages of one replica, over torch.distributed.

Every rank receives every StepInput and lays the step's tokens out identically (the runner
sorts them the same way from the same message), so stage k only has to send stage k+1 the
hidden states and residual of its last layer: two [num_tokens, hidden_size] tensors. Tensors
travel as raw bytes (gloo on CPU; NCCL would carry them on GPU).
"""

import datetime
import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class PipelineLink:
    """This rank's place in the replica's process group and its neighbours."""

    def __init__(self, init_method: str, rank: int, world_size: int, pp_rank: int,
                 pp_size: int, tp_size: int, timeout_s: float) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        # Same tp_rank in the previous / next stage.
        self.prev_rank = rank - tp_size if pp_rank > 0 else None
        self.next_rank = rank + tp_size if pp_rank < pp_size - 1 else None
        log.info("joined %s group %s as rank %d of %d (pp_rank %d/%d)", backend, init_method,
                 rank, world_size, pp_rank, pp_size)

    def recv(self, num_tokens: int, hidden_size: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and residual from the previous stage, each [num_tokens, hidden]."""
        assert self.prev_rank is not None
        tensors = []
        for _ in range(2):
            buf = torch.empty(num_tokens, hidden_size, dtype=dtype)
            dist.recv(buf.view(torch.uint8), src=self.prev_rank)
            tensors.append(buf)
        return tensors[0], tensors[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.next_rank is not None
        for t in (hidden, residual):
            dist.send(t.contiguous().view(torch.uint8), dst=self.next_rank)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
