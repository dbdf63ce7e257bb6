"""RoPE inverse frequencies, with the "linear", "llama3" and "yarn" context-extension scalings.

Each follows transformers' `modeling_rope_utils` (`_compute_linear_scaling_rope_parameters`,
`_compute_llama3_parameters`, `_compute_yarn_parameters`) formula for formula, so an exported model's logits
match transformers' (tests/checkpoint/test_rope_scaling.py); computed in float64 here.
- linear (kaiokendev 2023; Chen et al. 2023, position interpolation): every frequency divided by `factor`.
- llama3 (Llama 3.1, Dubey et al. 2024): wavelengths above original_max_seq_len / low_freq_factor divided by
  `factor`, below original_max_seq_len / high_freq_factor kept, a smooth interpolation in between.
- yarn (Peng et al. 2023): a linear ramp over dimensions between interpolated and extrapolated frequencies,
  bounded by beta_fast/beta_slow rotations, and cos/sin scaled by the attention factor (`attention_factor`).
Shape legend: E head dim.
"""

from __future__ import annotations

import math

import torch

from models.config import RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
             device: torch.device | None = None) -> torch.Tensor:
    """(E/2,) float64 inverse frequencies theta^(-2i/E), scaled as `scaling.type` says."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    kind = scaling.type if scaling is not None else "none"
    if scaling is None or kind == "none":
        return base
    if kind == "linear":
        return base / scaling.factor
    if kind == "llama3":
        return _llama3(base, scaling)
    return _yarn(base, head_dim, theta, scaling)


def attention_factor(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by: yarn's mscale (0.1 ln(factor) + 1 by default), else 1."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def _llama3(base: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old = s.original_max_seq_len
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / s.factor, base)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=base.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
    return base / s.factor * (1 - extrapolation) + base * extrapolation


__all__ = ["attention_factor", "inv_freq"]
