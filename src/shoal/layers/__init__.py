"""Shared building blocks for model files: attention over packed sequences, rotary positions,
norms, fused projections, activations, and LoRA deltas per token group at the Linear seam."""

from .activation import activation
from .attention import AttentionMeta, varlen_attention
from .linear import FusedLinear
from .lora import AdapterFactors, LoraFactors, LoraRouting, LoraShard
from .norm import RMSNorm
from .rotary import Rotary, apply_rotary

__all__ = ["AdapterFactors", "AttentionMeta", "FusedLinear", "LoraFactors", "LoraRouting", "LoraShard", "RMSNorm",
           "Rotary", "activation", "apply_rotary", "varlen_attention"]
