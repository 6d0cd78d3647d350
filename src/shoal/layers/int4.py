"""4-bit weights for a decoder's Linears on a CPU: what a generating card's `quantize: int4` swaps in.

A decode step of one sequence reads every weight once for one token's product, so its time is the
weights' bytes over the memory's bandwidth: float32 Linears read 4 bytes a weight, int4 ones half a
byte. `Int4Linear.of(linear)` stands in for an `nn.Linear` (an `Int4FusedLinear` for a
`FusedLinear`, keeping its shards and `split`) with the same contract: float32 `[..., in]` in,
float32 `[..., out]` out, bias included.

- Weights: 4 bits, asymmetric, in groups of GROUP (32) consecutive input channels of a row: a
  group's 16 levels run from its smallest weight to its largest, `w = (q - 8) * scale + zero` with
  a bfloat16 scale and zero per group. A checkpoint that was 4-bit already (llama.cpp's Q4_1 file,
  which stores blocks of 32 as `d * q + min`, q in 0..15) gets its own levels back: the block's
  smallest weight is its min, its largest min + 15 d; only the scale and zero round to bfloat16.
- Product: torch's `_weight_int4pack_mm_for_cpu` over the packed weights (converted once at load),
  activations in bfloat16 (its fast kernels take bfloat16; float32 ones run a reference loop ~30x
  slower), float32 accumulation, a bfloat16 result widened back to float32. So the answers are not
  float32's token for token, which is why the card opts in (docs/generate.md has how far they
  agree). llama.cpp's own Q4_1 products round the activations coarser still, to 8 bits per block.

A Linear whose input width is not a multiple of GROUP, or whose output width is not a multiple of
the kernel's tile (N_TILE), keeps its float32 weights.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn

from .linear import FusedLinear, Shards

GROUP = 32  # input channels per scale and zero (llama.cpp's Q4_0/Q4_1 block)
N_TILE = 16  # the packed layout's output rows per tile
_INNER_K_TILES = 2  # the packing's inner tiles along the input (2, 4 or 8)
_MAX_LEVEL = 15
_MID = 8  # the kernel's w = (q - 8) * scale + zero
_TINY = 1e-12  # a constant group gets a scale, not a division by zero


@functools.cache
def available() -> bool:
    """Whether this torch has the CPU int4 kernel and it gives the right sum."""
    try:
        w = torch.ones(N_TILE, GROUP)
        linear = nn.Linear(GROUP, N_TILE, bias=False)
        linear.weight = nn.Parameter(w, requires_grad=False)
        y = Int4Linear.of(linear)(torch.ones(1, GROUP))
        return bool(torch.allclose(y, torch.full((1, N_TILE), float(GROUP))))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False


def fits(linear: nn.Linear) -> bool:
    """Whether the kernel takes this Linear's shape (see the module)."""
    return linear.in_features % GROUP == 0 and linear.out_features % N_TILE == 0


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[out, in]` float -> its levels `[out, in]` int32 in 0..15 and the groups' scales
    and zeros `[in / GROUP, out, 2]` bfloat16, as the kernel takes them."""
    rows, width = weight.shape
    groups = weight.detach().float().reshape(rows, width // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)  # [out, in / GROUP]
    scale = ((high - low) / _MAX_LEVEL).clamp_min(_TINY)
    levels = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, _MAX_LEVEL)
    scale16 = scale.to(torch.bfloat16)
    # The zero from the rounded scale, so the group's smallest weight (level 0) keeps its value
    # as nearly as bfloat16 allows.
    zero16 = (low + _MID * scale16.float()).to(torch.bfloat16)
    scales_and_zeros = torch.stack([scale16, zero16], -1).transpose(0, 1).contiguous()  # [in / GROUP, out, 2]
    return levels.to(torch.int32).reshape(rows, width), scales_and_zeros


class Int4Linear(nn.Module):
    """`y = x @ W^T + b` with W in 4 bits per weight (see the module)."""

    # Buffers (registered in __init__).
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # Buffers, not parameters: nothing trains them, and the engine reads the activations'
        # dtype off the model's parameters (float32 here).
        self.register_buffer("packed", packed)  # [out, in / 2] uint8, the kernel's layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / GROUP, out, 2] bfloat16
        self.register_buffer("bias", bias)  # [out] float32, or None

    @classmethod
    def of(cls, linear: nn.Linear) -> Int4Linear:
        """The int4 stand-in for `linear` (a float32 CPU Linear, or a FusedLinear); ValueError if
        the kernel does not take its shape (`fits`)."""
        if not fits(linear):
            raise ValueError(
                f"int4 takes Linears of input width a multiple of {GROUP} and output width a multiple "
                f"of {N_TILE}, not {linear.in_features} -> {linear.out_features}"
            )
        levels, scales_and_zeros = quantize_groups(linear.weight)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, _INNER_K_TILES)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        parts = (packed, scales_and_zeros, bias, linear.in_features, linear.out_features)
        if isinstance(linear, FusedLinear):
            return Int4FusedLinear(*parts, shard_sizes=linear.shard_sizes)
        return cls(*parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros).float()
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4FusedLinear(Shards, Int4Linear):
    """A `FusedLinear` in int4: one product for the shards, `split` cuts the output as it did."""


class Int8WeightLinear(nn.Module):
    """`y = x @ W^T` with W in int8, one symmetric scale per output row, activations bfloat16 at
    the product (torch's `_weight_int8pack_mm`; float32 activations run its slow path): the LM head
    of a card under `quantize: int4`, at the 8 bits llama.cpp's files keep their embeddings and
    head in (Q8_0), where 4 bits would change the greedy answers more (docs/benchmarks.md)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out] bfloat16

    @classmethod
    def of(cls, weight: torch.Tensor) -> Int8WeightLinear:
        """From a float `[out, in]` weight (e.g. tied embeddings)."""
        w = weight.detach().float()
        scale = w.abs().amax(1).clamp_min(_TINY) / 127
        levels = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(levels, scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale).float()
        return y.view(*lead, self.out_features)

    @property
    def num_bytes(self) -> int:
        """Its weights' and scales' bytes (it stands apart from the model's modules: the decoder's head)."""
        return self.weight.nbytes + self.scale.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def quantize_linears_int4(model: nn.Module) -> tuple[str, ...]:
    """Replace every float32 `nn.Linear` / `FusedLinear` of `model` whose shape the kernel takes
    by its int4 stand-in, in place; returns their names. Embeddings, norms and the LM head (held
    outside the model) stay as they are."""
    names = tuple(
        name
        for name, m in model.named_modules()
        if type(m) in (nn.Linear, FusedLinear) and m.weight.dtype == torch.float32 and fits(m)
    )
    for name in names:  # one at a time, so each float32 weight can go as its int4 copy is made
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, Int4Linear.of(cast(nn.Linear, getattr(owner, child))))
    return names
