"""Linear layers that checkpoints store as several tensors."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


class FusedLinear(nn.Linear):
    """One matmul for projections a checkpoint stores apart (q, k, v; gate, up).

    `shard_sizes` are the output sizes of the parts in order; the weight loader writes part i of
    the checkpoint into rows `sum(shard_sizes[:i])` onwards. `split` cuts the output the same way.
    """

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool = True) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # torch.split takes any sequence of sizes; its stub says list
        return torch.split(self(x), cast("list[int]", self.shard_sizes), dim=-1)
