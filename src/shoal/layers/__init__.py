"""Shared building blocks for model files: attention over packed sequences, activations."""

from .activation import activation
from .attention import AttentionMeta, varlen_attention
from .linear import FusedLinear

__all__ = ["AttentionMeta", "FusedLinear", "activation", "varlen_attention"]
