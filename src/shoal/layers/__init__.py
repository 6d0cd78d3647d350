"""Shared building blocks for model files: attention over packed sequences, rotary positions,
norms, fused projections, activations."""

from .activation import activation
from .attention import AttentionMeta, varlen_attention
from .linear import FusedLinear
from .norm import RMSNorm
from .rotary import Rotary, apply_rotary

__all__ = ["AttentionMeta", "FusedLinear", "RMSNorm", "Rotary", "activation", "apply_rotary", "varlen_attention"]
