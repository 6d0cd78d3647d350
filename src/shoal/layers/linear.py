"""Linear layers that checkpoints store as several tensors."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn


class Shards:
    """A Linear whose output is its parts' outputs side by side (q | k | v; gate | up): `split`
    cuts it into `shard_sizes`. Mixed in before a Linear stand-in (packed, int8, int4), it takes the
    stand-in's own arguments and `shard_sizes` by keyword."""

    shard_sizes: tuple[int, ...]

    def __init__(self, *parts: Any, shard_sizes: tuple[int, ...], **named: Any) -> None:
        super().__init__(*parts, **named)
        self.shard_sizes = shard_sizes

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # torch.split takes any sequence of sizes; its stub says list
        return torch.split(cast("nn.Module", self)(x), cast("list[int]", self.shard_sizes), dim=-1)


class FusedLinear(Shards, nn.Linear):
    """One matmul for projections a checkpoint stores apart (q, k, v; gate, up).

    `shard_sizes` are the output sizes of the parts in order; the weight loader writes part i of
    the checkpoint into rows `sum(shard_sizes[:i])` onwards. `split` cuts the output the same way.
    """

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool = True) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias, shard_sizes=shard_sizes)
