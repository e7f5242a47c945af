"""`elementwise.c`: the per-token steps of a layer (residual add + RMSNorm, SiLU-and-multiply,
rotary embedding) and greedy argmax, one pass each instead of several torch kernels whose
per-call overhead dominates at decode sizes. Its torch twin, `TorchElementwise` (same methods),
is below: the model uses it where the C kernels do not build or are off, and tests compare
the two. `argmax_float`, the argmax twin, is also the sampler's (worker_svc.sampler) default
greedy path."""

import ctypes

import torch
import torch.nn.functional as F

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class ElementwiseKernels:
    """`elementwise.c` for one dtype: the per-token steps of a layer in one pass each."""

    __slots__ = ("lib", "dtype")

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype):
        self.lib, self.dtype = library, dtype
        library.add_rms_norm.restype = None
        library.add_rms_norm.argtypes = [_P, _P, _P, _F, _P, _P, _I, _I]
        library.silu_mul.restype = None
        library.silu_mul.argtypes = [_P, _P, _I, _I]
        library.rotary.restype = None
        library.rotary.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I]
        library.argmax_rows.restype = None
        library.argmax_rows.argtypes = [_P, _I, _I, _P]

    def _check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != self.dtype or not t.is_contiguous():
                raise ValueError(f"elementwise kernel: expected contiguous {self.dtype}, got "
                                 f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [rows, dim] (residual None: x alone) -> (x + residual, its RMSNorm
        times weight), both new tensors."""
        self._check(x, weight, *(() if residual is None else (residual,)))
        rows, dim = x.shape
        if weight.shape != (dim,) or (residual is not None and residual.shape != x.shape):
            raise ValueError("add_rms_norm: mismatched shapes")
        new_residual, normed = torch.empty_like(x), torch.empty_like(x)
        self.lib.add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                              weight.data_ptr(), eps, new_residual.data_ptr(),
                              normed.data_ptr(), rows, dim)
        return new_residual, normed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate, then up) -> silu(gate) * up, [rows, inter]."""
        self._check(gate_up)
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self.lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rotary_(self, x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate, in place, the first `num_heads` heads of each row of x [rows, width >=
        num_heads * head_dim] (rows contiguous) by the cos / signed-sin tables [max_positions,
        head_dim] at positions [rows] (int64)."""
        self._check(x, cos, sin)
        if (positions.dtype != torch.int64 or not positions.is_contiguous()
                or positions.shape != (x.shape[0],) or x.shape[1] < num_heads * head_dim
                or cos.shape[1] != head_dim or sin.shape != cos.shape or head_dim % 2):
            raise ValueError("rotary: mismatched shapes")
        self.lib.rotary(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(),
                        sin.data_ptr(), x.shape[0], num_heads, head_dim)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] -> int64 [rows]: each row's first maximum, as torch.argmax(dim=-1)."""
        self._check(x)
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"argmax: expected [rows, cols > 0], got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out



def elementwise_kernels(level: CpuLevel, dtype: torch.dtype) -> ElementwiseKernels | None:
    """The elementwise kernels for this dtype at this CPU level, or None (use torch)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    library = build("elementwise.c", level, {"ELEM_BF16": int(dtype == torch.bfloat16)})
    return None if library is None else ElementwiseKernels(library, dtype)


def rotary_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The [max_positions, head_dim] tables' rows at positions, each [num_tokens, 1, head_dim]."""
    return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> rotated copy (HF rotate_half convention)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def argmax_float(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows], first maximum, in torch (TorchElementwise.argmax too)."""
    return logits.float().argmax(dim=-1)   # (argmax over bfloat16 is ~3x slower on CPU)


class TorchElementwise:
    """The torch twin of `worker_svc.kernels.ElementwiseKernels` (same methods), used where
    the C kernels did not build or are off."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else x + residual
        return residual, F.rms_norm(residual, weight.shape, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary_(x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
        heads = x[:, :num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
        heads.copy_(apply_rotary(heads, *rotary_rows(cos, sin, positions)))

    argmax = staticmethod(argmax_float)
