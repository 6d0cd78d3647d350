"""float32 Linears with oneDNN-packed weights, for CPU: what a float32 CPU model runs by default.

`PackedLinear.of(linear)` stands in for an `nn.Linear` (a `PackedFusedLinear` for a `FusedLinear`,
keeping its shards and `split`) with the same contract and the same arithmetic (float32 in,
float32 accumulate, float32 out): the weight is reordered once, at load, into oneDNN's blocked
layout for this CPU, and each call is one `mkldnn._linear_pointwise` (the inner-product primitive
torch's own compiler uses) instead of MKL's sgemm on the plain `[out, in]` matrix, which runs the
projections faster (docs/benchmarks.md, CPU kernels). The float32 weight is not kept: the packed copy
is the only one (its bytes are counted by `packed_bytes`).

A LoRA adapter's forward hook (layers/lora.py) sees this module as it sees any Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import FusedLinear, Shards

# The batch size oneDNN picks the packed layout for (any batch runs; this is the common one).
_PACK_FOR_TOKENS = 4096


def available() -> bool:
    """Whether this torch has the oneDNN inner-product ops (x86 and aarch64 CPU builds do)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """`y = x @ W^T + b`, W in oneDNN's packed layout (an opaque tensor, not a parameter)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed  # [out, in] float32, opaque (torch._mkldnn layout)
        self.register_buffer("bias", bias)  # [out] float32, or None

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("oneDNN packing is for float32 CPU Linears")
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_FOR_TOKENS)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if isinstance(linear, FusedLinear):
            return PackedFusedLinear(
                packed, bias, linear.in_features, linear.out_features, shard_sizes=linear.shard_sizes
            )
        return cls(packed, bias, linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def num_bytes(self) -> int:
        return self.in_features * self.out_features * 4

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedFusedLinear(Shards, PackedLinear):
    """A `FusedLinear` packed: one product for the shards, `split` cuts the output as it did."""


def pack_linears(model: nn.Module) -> int:
    """Swap every float32 CPU `nn.Linear` / `FusedLinear` of `model` (exactly those types: other
    stand-ins, e.g. int8, are left as they are) for its packed stand-in; returns the packed bytes."""
    # Names first, modules looked up one at a time: a list of the modules would keep every float32
    # weight alive until the last is packed (twice the Linears' bytes at load).
    names = [
        name
        for name, m in model.named_modules()
        if type(m) in (nn.Linear, FusedLinear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    ]
    total = 0
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        packed = PackedLinear.of(getattr(owner, child))
        setattr(owner, child, packed)
        total += packed.num_bytes
    return total


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights in `model` (not parameters or buffers, so counted here): float32
    Linears packed here, and int8 ones that keep their weights only in oneDNN's layout."""
    from .int8 import Int8Linear

    return sum(m.num_bytes for m in model.modules() if isinstance(m, (PackedLinear, Int8Linear)))
