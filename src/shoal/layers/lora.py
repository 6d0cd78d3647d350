"""LoRA deltas at the Linear seam, per token group, never merged into the shared weights.

A batch may mix sequences of several adapters and of the bare base model. Every Linear an adapter
targets computes its base output `y = x @ W^T + b` over all `[T, in]` tokens as usual; then, for
each adapter g in the batch, the rows of its tokens gain `scale_g * (x_g @ A_g^T) @ B_g^T`, and for
a fused projection (q | k | v in one `FusedLinear`) only in the output columns of the shards the
adapter targets. Rows of base-model sequences are never written, so they stay bit-exact.

`LoraRouting` is built once per forward from the batch's per-sequence adapter slots: the adapted
tokens ordered by adapter (one index `[Ta]`, or a plain slice when the batch already holds them in
that order) and each adapter's range in that order. `LoraRouting.applied(model)` installs it on
that model's targeted Linears, as forward hooks that live only for the duration of the forward,
on those module instances only (several models share a process; nothing is global). A batch
without adapters never builds one: the model runs untouched.

Per targeted Linear and forward: two small matmuls per adapter (`LoraFactors` stacks a fused
Linear's shards, so the update is two matmuls whatever the shards), added into y's rows in place
when the adapted tokens are a slice; otherwise one gather of their rows of x and one scatter-add of
the deltas into y. Whoever packs a batch gets the slice by putting each adapter's sequences side by
side in slot order, with base sequences before or after them (bench/lora_forward.py measures it).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import nn

from ..errors import InferenceFailed

if TYPE_CHECKING:
    from .int8 import Int8Linear
    from .packed import PackedLinear


class LoraShard(NamedTuple):
    """One checkpoint projection's LoRA factors, as PEFT stores them."""

    shard: int | None  # index into the Linear's `shard_sizes`; None: its whole output
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out_of_shard, r]
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA


@dataclass(frozen=True)
class LoraFactors:
    """One adapter's update of one Linear: output columns `columns` of its tokens gain
    `(x @ a^T) @ b_t`.

    The targeted shards are stacked: `a` holds each shard's A rows one after another, `b_t` each
    shard's `scale * B^T` in its own rank rows and output columns (zeros elsewhere), over the
    columns from the first targeted shard's start to the last one's end.
    """

    a: torch.Tensor  # [R, in], R = the targeted shards' ranks summed
    b_t: torch.Tensor  # [R, end - start], scale folded in
    columns: tuple[int, int]  # (start, end) output columns of the Linear

    @classmethod
    def stack(cls, linear: nn.Linear | Int8Linear | PackedLinear, shards: Sequence[LoraShard]) -> LoraFactors:
        """Stack `shards` (distinct, each shaped for its shard of `linear`) into one update, in
        float32 on the factors' device; `to` moves it to the model's device and dtype."""
        sizes = getattr(linear, "shard_sizes", (linear.out_features,))
        offsets = [0, *itertools.accumulate(sizes)]
        spans = [
            (0, linear.out_features) if s.shard is None else (offsets[s.shard], offsets[s.shard + 1]) for s in shards
        ]
        start, end = min(lo for lo, _ in spans), max(hi for _, hi in spans)
        a = torch.cat([s.a.float() for s in shards])  # [R, in]
        b_t = a.new_zeros(a.shape[0], end - start)  # [R, end - start]
        rank_row = 0
        for s, (lo, hi) in zip(shards, spans):
            r = s.a.shape[0]
            b_t[rank_row : rank_row + r, lo - start : hi - start] = (s.b.float() * s.scale).T
            rank_row += r
        return cls(a, b_t, (start, end))

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LoraFactors:
        return LoraFactors(
            self.a.to(device=device, dtype=dtype).contiguous(),
            self.b_t.to(device=device, dtype=dtype).contiguous(),
            self.columns,
        )

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b_t))


# One adapter as a forward sees it: shoal module name (e.g. "layers.0.qkv") -> its update.
AdapterFactors = Mapping[str, LoraFactors]


@dataclass(frozen=True)
class LoraRouting:
    """Which token rows of one packed batch each adapter owns: built once per forward.

    The adapted tokens, ordered by adapter, are `rows` of the batch (`[Ta]` int64), or, when
    `rows` is None, the slice `span` of it already in that order. Adapter k owns positions
    `groups[k][0]:groups[k][1]` of that order.
    """

    num_tokens: int  # T
    rows: torch.Tensor | None  # [Ta] int64, on the model's device
    span: tuple[int, int]
    groups: tuple[tuple[int, int, AdapterFactors], ...]

    @classmethod
    def build(
        cls, cu_seqlens: np.ndarray, slots: np.ndarray, adapters: Mapping[int, AdapterFactors], device: torch.device
    ) -> LoraRouting | None:
        """Routing for sequences bounded by `cu_seqlens` `[n+1]`, sequence i using adapter
        `slots[i]` (`[n]`, -1: the base model) of `adapters`; None when no sequence uses one."""
        cu = cu_seqlens.astype(np.int64)
        adapted = np.flatnonzero(slots >= 0)
        if adapted.size == 0:
            return None
        order = adapted[np.argsort(slots[adapted], kind="stable")]  # adapted sequences, by slot
        lengths = cu[order + 1] - cu[order]
        ends = np.cumsum(lengths)  # end of each sequence within the adapted order
        rows = np.repeat(cu[order] - (ends - lengths), lengths) + np.arange(int(ends[-1]))  # [Ta]
        groups = []
        slot_of = slots[order]
        cuts = np.flatnonzero(np.diff(slot_of)) + 1  # where the slot changes
        for first, last in zip([0, *cuts], [*cuts, len(order)]):
            start = int(ends[first] - lengths[first])
            groups.append((start, int(ends[last - 1]), adapters[int(slot_of[first])]))
        lo, num_rows = int(rows[0]), len(rows)
        in_place = bool(rows[-1] - lo + 1 == num_rows and np.all(np.diff(rows) == 1))
        index = None if in_place else torch.from_numpy(rows).to(device)
        return cls(int(cu[-1]), index, (lo, lo + num_rows), tuple(groups))

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """While the block runs, every Linear of `model` that an adapter of this batch targets adds
        its deltas to its output; afterwards the model is as it was."""
        plans: dict[str, list[tuple[int, int, LoraFactors]]] = {}
        for start, end, factors in self.groups:
            for name, update in factors.items():
                plans.setdefault(name, []).append((start, end, update))
        calls = dict.fromkeys(plans, 0)
        handles = [
            model.get_submodule(name).register_forward_hook(functools.partial(self._add, name, plan, calls))
            for name, plan in plans.items()
        ]
        try:
            yield
            skipped = [name for name, count in calls.items() if count == 0]
            if skipped:  # a model that bypasses the module (F.linear on its weight) would drop the delta
                raise InferenceFailed(
                    f"adapted modules {', '.join(skipped[:4])} were never called by the "
                    "model's forward: their LoRA deltas could not be applied"
                )
        finally:
            for handle in handles:
                handle.remove()

    def _add(
        self,
        name: str,
        plan: list[tuple[int, int, LoraFactors]],
        calls: dict[str, int],
        module: nn.Module,
        inputs: tuple,
        y: torch.Tensor,
    ) -> None:
        """The forward hook: `y` `[T, out]` (the Linear's output on `inputs[0]` `[T, in]`) gains
        each adapter's delta in its rows, in place."""
        x = inputs[0]
        calls[name] += 1
        if calls[name] > 1 or x.shape[0] != self.num_tokens:
            # Per-token routing holds only for one call over the batch's tokens (DeBERTa projects its
            # shared relative-position embeddings through the same Linears).
            raise InferenceFailed(
                f"an adapter targets {name}, which the model also applies to something "
                "other than the batch's tokens; adapters cannot target it on this model"
            )
        if self.rows is None:  # the adapted rows are a slice: add into y's rows in place
            lo, hi = self.span
            xa, ya = x[lo:hi], y[lo:hi]  # [Ta, in], [Ta, out], views
            for start, end, update in plan:
                c0, c1 = update.columns
                ya[start:end, c0:c1].addmm_(xa[start:end] @ update.a.T, update.b_t)  # [Tg, c1 - c0]
            return
        # Gathered rows: the deltas go to a buffer over the columns any adapter touches, then into y
        # in one scatter (cheaper than gathering y's rows and writing them back).
        first, last = min(u.columns[0] for _, _, u in plan), max(u.columns[1] for _, _, u in plan)
        # Every row written by exactly one matmul: no zeroing (rows of an adapter that leaves this
        # module alone, or columns outside an adapter's shards, must be zeros).
        same = len(plan) == len(self.groups) and all(u.columns == (first, last) for _, _, u in plan)
        xa = x.index_select(0, self.rows)  # [Ta, in]
        delta = (y.new_empty if same else y.new_zeros)(xa.shape[0], last - first)  # [Ta, last - first]
        for start, end, update in plan:
            c0, c1 = update.columns
            h = xa[start:end] @ update.a.T  # [Tg, R]
            if same:
                torch.mm(h, update.b_t, out=delta[start:end])
            else:
                delta[start:end, c0 - first : c1 - first].addmm_(h, update.b_t)
        y[:, first:last].index_add_(0, self.rows, delta)
