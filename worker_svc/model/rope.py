"""RoPE tables: each frequency by the model's rule (plain, linear, llama3, yarn, GGUF's
per-frequency factors), then cos/sin for every position.

Every rule is computed in float32 in the order transformers computes it (its
`ROPE_INIT_FUNCTIONS`), so the tables equal HF's bit for bit where the arithmetic allows;
tests/worker_svc/test_rope.py compares them. A rule changes only the tables (and, for yarn, a
factor on cos and sin), so every kernel path (C, torch, Triton) gets it through the tables.
"""

import math

import torch

from services.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None
                        ) -> tuple[torch.Tensor, float]:
    """[head_dim / 2] float32 rotation speeds, and the factor on cos / sin (1 but for yarn)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    if scaling is None:
        return 1.0 / (theta ** exponents), 1.0
    kind = scaling.rope_type
    if kind == "linear":                # positions / factor == frequencies / factor
        return 1.0 / (theta ** exponents) / scaling.factor, 1.0
    if kind == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        return 1.0 / (theta ** exponents) / factors, 1.0
    if kind == "llama3":
        return _llama3(1.0 / (theta ** exponents), scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"RoPE scaling {kind!r} is not implemented")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths (past original / low_freq_factor) slowed by `factor`, short ones
    (under original / high_freq_factor) kept, and a smooth blend of the two between."""
    original = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original / s.low_freq_factor, inv_freq / s.factor,
                         inv_freq)
    blend = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor
                                                           - s.low_freq_factor)
    blended = (1 - blend) * slowed / s.factor + blend * slowed
    between = (wavelength >= original / s.high_freq_factor) & (
        wavelength <= original / s.low_freq_factor)
    return torch.where(between, blended, slowed)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """Dimensions that turn more than beta_fast times over the original context keep their
    speed (extrapolate), those under beta_slow turns are slowed by `factor` (interpolate), a
    linear ramp between; cos and sin are scaled by the attention factor."""
    base_speeds = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    original = s.original_max_position_embeddings

    def dimension_of(turns: float) -> float:      # the dimension that turns `turns` times
        return (head_dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                  # 1: extrapolate, 0: interpolate
    inv_freq = (1.0 / (s.factor * base_speeds)) * (1 - keep) + (1.0 / base_speeds) * keep
    return inv_freq, _yarn_attention_factor(s)


def _yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


class RotaryEmbedding:
    """cos/sin tables for every position, in the model dtype, computed in float32 like HF."""

    __slots__ = ("cos", "sin")

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device | None = None, scaling: RopeScaling | None = None):
        inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)                # [max_positions, head_dim]
        half = head_dim // 2
        self.cos = (angles.cos() * attention_factor).to(device=device, dtype=dtype)
        # rotate_half(x) * sin == roll(x, half) * sin_signed, with the first half negated.
        sin = angles.sin() * attention_factor
        sin[:, :half] = -sin[:, :half]
        self.sin = sin.to(device=device, dtype=dtype)
