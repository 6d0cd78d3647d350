"""The dense head: pooling over packed encoder output, then per-sequence Matryoshka truncation,
normalisation and output dtype.

Pooling works on `[T, hidden]` with the batch's `AttentionMeta`; post-processing works on numpy
vectors, one per sequence, since each request may ask for different dimensions and dtypes.
"""

from __future__ import annotations

import numpy as np
import torch

from ..layers import AttentionMeta
from ..vectors import finish


def pool(hidden: torch.Tensor, meta: AttentionMeta, method: str) -> torch.Tensor:
    """`[T, hidden]` -> `[n, hidden]`, one vector per sequence."""
    starts, ends = meta.cu_seqlens[:-1].long(), meta.cu_seqlens[1:].long()
    if method == "cls":
        return hidden[starts]
    if method == "last":
        return hidden[ends - 1]
    if method == "mean":
        sums = hidden.new_zeros(meta.num_seqs, hidden.shape[1]).index_add_(0, meta.seq_index, hidden)
        return sums / (ends - starts).to(hidden.dtype)[:, None]
    raise ValueError(f"unknown pooling {method!r}")


class PoolingHead:
    """`dense`: one pooled vector per sequence, finished per its spec."""

    output = "dense"

    def __init__(self, method: str) -> None:
        self.method = method

    @classmethod
    def build(cls, ctx) -> "PoolingHead":
        return cls(ctx.card.pooling)

    def run(self, hidden, specs) -> list[np.ndarray | None]:
        vectors = pool(hidden.states, hidden.meta, self.method).float().cpu().numpy()  # [n, h]
        return [finish(vectors[i], dimensions=s.dimensions, normalize=s.normalize, output_dtype=s.output_dtype)
                if "dense" in s.outputs else None for i, s in enumerate(specs)]
