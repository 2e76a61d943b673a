"""Rotary position embeddings (Hugging Face ``rotate_half`` convention): the angles.

Head dimensions are rotated in two halves: pair ``(x[i], x[i + d/2])`` turns by angle
``position * inv_freq[i]``. The cache holds cos/sin for the half dimension only;
:func:`kernels.rotary.apply_rotary` applies them as ``x1*cos - x2*sin, x2*cos + x1*sin``,
bit-identical to HF's ``x*cat(cos, cos) + rotate_half(x)*cat(sin, sin)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:  # [head_dim // 2] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_frequencies(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_inv_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: stretch long wavelengths by ``factor``, keep short ones, blend in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for positions ``[0, max_positions)``, looked up per token."""

    cos_sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)  # [head_dim // 2]
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos_sin", cos_sin.to(device), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, 1, head_dim // 2]
        cos_sin = self.cos_sin.index_select(0, positions).to(dtype)  # [num_tokens, head_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin
