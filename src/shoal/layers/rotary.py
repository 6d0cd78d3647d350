"""Rotary position embeddings over packed tokens (the "rotate half" layout of GPT-NeoX, Llama,
Qwen, ModernBERT and NomicBERT).

Angles are computed from each token's own position id, so packing needs no special care.
"""

from __future__ import annotations

import torch


class Rotary:
    """cos/sin tables for `rotary_dim` of each head (all of it by default). Holds no parameters."""

    def __init__(self, head_dim: int, base: float, rotary_dim: int | None = None) -> None:
        self.rotary_dim = rotary_dim or head_dim
        self.base = base

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """`[rotary_dim / 2]` rotation frequencies; subclasses rescale them (long-context variants)."""
        exponent = torch.arange(self.rotary_dim // 2, device=device, dtype=torch.float32) * 2.0 / self.rotary_dim
        return 1.0 / (self.base**exponent)

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T]` positions -> cos, sin of shape `[T, 1, rotary_dim]` (broadcast over heads)."""
        inv_freq = self.inv_freq(position_ids.device)  # [rotary_dim / 2]
        angles = position_ids.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [T, 1, rotary_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` channels of `x` `[T, H, D]`; the rest pass through."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated
