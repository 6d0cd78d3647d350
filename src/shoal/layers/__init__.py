"""Shared building blocks for model files: the packed batch a model takes (`PackedInputs`),
attention over packed sequences (the one seam where kernels are chosen), rotary positions,
norms, fused projections, activations, feed-forward blocks run a block of rows at a time (CPU),
and, at the Linear seam, LoRA deltas per token group and int8 weights and activations (CPU)."""

from .activation import activation
from .attention import PositionBias, ScoreBias, varlen_attention
from .attention_meta import AttentionMeta
from .inputs import PackedInputs
from .int8 import Int8FusedLinear, Int8Linear, input_maxima, quantize_linears
from .linear import FusedLinear
from .lora import AdapterFactors, LoraFactors, LoraRouting, LoraShard
from .norm import RMSNorm
from .rotary import Rotary, apply_rotary
from .rows import in_row_blocks

__all__ = [
    "AdapterFactors",
    "AttentionMeta",
    "FusedLinear",
    "Int8FusedLinear",
    "Int8Linear",
    "LoraFactors",
    "LoraRouting",
    "LoraShard",
    "PackedInputs",
    "PositionBias",
    "RMSNorm",
    "Rotary",
    "ScoreBias",
    "activation",
    "apply_rotary",
    "in_row_blocks",
    "input_maxima",
    "quantize_linears",
    "varlen_attention",
]
