"""The packed batch's attention metadata, built once per forward and read by every layer.

`AttentionMeta` holds the batch's sequence boundaries (`cu_seqlens` `[n+1]`), the padded view each
token maps to, and, for ColBERT-style query expansion, `key_lengths` `[n]`: only the first
`key_lengths[i]` tokens of sequence i are keys, though every token is still a query. For the padded
kernel (layers/attention.py) it cuts the batch into `LengthGroup`s: sequences sorted by length and
padded only to their own group's longest, so a batch mixing short and long texts does not pay L_max²
for every sequence. Rows move in and out of a group's `[ng, Lg, ...]` view through one flat slot index.

A group's additive mask is built once per forward, kind and dtype (cached on the group), never per
layer, and no `[L, L]` mask is ever copied per sequence: causal attention needs none (right padding
keeps every real query off the pad keys; the kernel's `is_causal` does it) unless keys are cut, then
one `[ng, 1, Lg, Lg]`; full attention gets an `[ng, 1, 1, Lg]` key mask; a window is one
`[1, 1, Lg, Lg]` band shared by the group. Masks are additive, in the query's dtype: that is what the
kernels consume; a bool mask would be converted to one (and its negation made) on every call, which
costs more than the float mask it saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

# Length groups by default: cut where a length more than doubles the group's shortest and grows by
# more than 32 tokens (`AttentionMeta.groups_within`).
GROUP_RATIO, GROUP_SLACK = 2.0, 32


@dataclass(frozen=True)
class LengthGroup:
    """Sequences of similar length, padded together: token `tokens[i]` of the packed batch sits at
    (seq_index[i], pos_in_seq[i]) of this group's `[num_seqs, max_seqlen]` view."""

    tokens: torch.Tensor  # [Tg] int64 indices into the packed batch
    seq_index: torch.Tensor  # [Tg]
    pos_in_seq: torch.Tensor  # [Tg]
    # [ng, Lg] bool, True where a key is attended to (a real token within its sequence's key length);
    # None when every position of the view is one.
    key_mask: torch.Tensor | None
    num_seqs: int
    max_seqlen: int
    # Some sequence has tokens past its key length (not only padding past its end): then even
    # causal attention, which needs no mask for right padding, needs the key mask.
    cuts_keys: bool = False
    # Additive masks by (kind, dtype), built on first use: one per forward, read by every layer.
    _masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def slots(self) -> torch.Tensor:
        """`[Tg]` int64: each row's slot in the flattened `[ng * Lg]` view."""
        return self.seq_index * self.max_seqlen + self.pos_in_seq

    def pad(self, x: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """This group's rows `[Tg, ..., D]` -> `[ng, Lg, ..., width]`, zeros where no token is and
        in channels past D."""
        return _scatter_rows(x, self.slots, self.num_seqs, self.max_seqlen, width)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """`[ng, Lg, ...]` -> this group's rows `[Tg, ...]`."""
        return _gather_rows(x, self.slots)

    def attention_mask(self, causal: bool, window: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask `varlen_attention` hands the kernel for this group, cached.

        None for causal attention without a window (the kernel's `is_causal` does it) and for
        full attention over unpadded sequences; `[1, 1, Lg, Lg]` for a window; `[ng, 1, 1, Lg]`
        (padding keys) for full attention otherwise.
        """
        key = (causal, window, dtype)
        if key not in self._masks:
            self._masks[key] = build_mask(self, causal, window, dtype)
        return self._masks[key]


def build_mask(g: LengthGroup, causal: bool, window: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor | None:
    """`LengthGroup.attention_mask`, uncached: 0 where a key is seen, -inf where not."""
    device = g.seq_index.device
    if window is not None:  # [Lg, Lg] band: query i sees keys i-left..i+right (..i when causal)
        left, right = window[0], min(window[1], 0) if causal else window[1]
        L = g.max_seqlen
        allowed = torch.ones(L, L, dtype=torch.bool, device=device).tril_(right).triu_(-left)  # [Lg, Lg]
        band = torch.zeros(L, L, dtype=dtype, device=device).masked_fill_(allowed.logical_not_(), float("-inf"))
        return band[None, None]  # [1, 1, Lg, Lg]
    if g.key_mask is None or (causal and not g.cuts_keys):
        return None
    if causal:  # [ng, 1, Lg, Lg]: query i sees keys ..i that are within its sequence's key length
        L = g.max_seqlen
        allowed = torch.ones(L, L, dtype=torch.bool, device=device).tril_()[None] & g.key_mask[:, None, :]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))[:, None]
    keys = torch.zeros(g.key_mask.shape, dtype=dtype, device=device).masked_fill_(~g.key_mask, float("-inf"))
    return keys[:, None, None, :]  # [ng, 1, 1, Lg]


@dataclass(frozen=True)
class AttentionMeta:
    """Boundaries of the packed batch, built once per forward and passed to every layer."""

    cu_seqlens: torch.Tensor  # [n+1] int32, on the model's device
    max_seqlen: int
    # For the padded path: token t lives at (seq_index[t], pos_in_seq[t]) of [n, L].
    seq_index: torch.Tensor  # [T] int64
    pos_in_seq: torch.Tensor  # [T] int64
    key_mask: torch.Tensor  # [n, L] bool, True where a real token is
    # [n] int32: sequence i's first key_lengths[i] tokens are the keys every one of its tokens
    # attends to; None: all of them are (the usual case).
    key_lengths: torch.Tensor | None = None
    # Whether the CPU "each" path may be taken (a card's `batching.attention: padded` says no).
    each: bool = True
    # The feed-forward blocks' row blocks (layers/rows.py): the widest intermediate one block may
    # hold, in bytes; 0: each layer's feed-forward runs over the whole batch at once.
    row_block_bytes: int = 0
    # `cu_seqlens` as host ints when the caller had them: `bounds` then never waits for the device.
    host_bounds: tuple[int, ...] | None = None
    # The padded path takes the whole batch as one group, built on the device from the tensors
    # above: nothing is read back, so a captured forward (engine/graphs.py) can hold it.
    whole: bool = False

    @cached_property
    def slots(self) -> torch.Tensor:
        """`[T]` int64: each token's slot in the flattened `[n * L]` padded view."""
        return self.seq_index * self.max_seqlen + self.pos_in_seq

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed `[T, ...]` -> padded `[n, L, ...]` (zeros where no token is)."""
        return _scatter_rows(x, self.slots, self.num_seqs, self.max_seqlen)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded `[n, L, ...]` -> packed `[T, ...]`."""
        return _gather_rows(x, self.slots)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @cached_property
    def bounds(self) -> list[int]:
        """`cu_seqlens` as Python ints (read once per forward; on a GPU, from the host's copy when
        the batch came with one, so the lane's stream is not synchronised mid-forward)."""
        return list(self.host_bounds) if self.host_bounds is not None else self.cu_seqlens.tolist()

    @cached_property
    def uniform(self) -> bool:
        """Every sequence has the same length (and every token is a key): no padding anywhere."""
        lengths = np.diff(self.bounds)
        return self.key_lengths is None and bool((lengths == lengths[0]).all())

    @cached_property
    def groups(self) -> tuple[LengthGroup, ...]:
        """Sequences sorted by length and cut where the length more than doubles (and grows by
        more than 32 tokens): each group pads to at most about twice its shortest member. A single
        group keeps the packed order, so attention over it needs no gather."""
        return self.groups_within(GROUP_RATIO, GROUP_SLACK)

    def groups_within(self, ratio: float, slack: int) -> tuple[LengthGroup, ...]:
        """Length groups cut where the length grows past `ratio` times the group's shortest (and
        by more than `slack` tokens); built once per (ratio, slack). A score bias whose padded work
        costs more than its kernel calls (DeBERTa's three score terms) asks for tighter groups
        (`ScoreBias.grouping`)."""
        key = ("whole",) if self.whole else (ratio, slack)
        cache = self.__dict__.setdefault("_groups_within", {})
        if self.whole and key not in cache:
            tokens = torch.arange(self.seq_index.numel(), device=self.cu_seqlens.device)
            group = LengthGroup(tokens, self.seq_index, self.pos_in_seq, self.key_mask, self.num_seqs, self.max_seqlen)
            cache[key] = (group,)
        if key not in cache:
            cache[key] = self._length_groups(ratio, slack)
        return cache[key]

    def _length_groups(self, ratio: float, slack: int) -> tuple[LengthGroup, ...]:
        bounds = np.asarray(self.bounds, dtype=np.int64)
        lengths = np.diff(bounds)
        order = np.argsort(lengths, kind="stable")
        cuts, first = [], int(lengths[order[0]])
        for rank, seq in enumerate(order):
            if lengths[seq] > max(ratio * first, first + slack):
                cuts.append(rank)
                first = int(lengths[seq])
        if not cuts:
            order = np.arange(len(lengths))
        key_lengths = lengths if self.key_lengths is None else self.key_lengths.cpu().numpy().astype(np.int64)
        groups = []
        for members in np.split(order, cuts):
            lens, keys = lengths[members], key_lengths[members]
            tokens = np.concatenate([np.arange(bounds[m], bounds[m + 1]) for m in members])
            seq_index = np.repeat(np.arange(len(members)), lens)
            pos_in_seq = tokens - np.repeat(bounds[members], lens)
            L = int(lens.max())
            mask = None if keys.min() == L else torch.from_numpy(np.arange(L)[None, :] < keys[:, None])
            to: dict[str, Any] = dict(device=self.cu_seqlens.device)
            groups.append(
                LengthGroup(
                    torch.from_numpy(tokens).to(**to),
                    torch.from_numpy(seq_index).to(**to),
                    torch.from_numpy(pos_in_seq).to(**to),
                    mask.to(**to) if mask is not None else None,
                    len(members),
                    L,
                    cuts_keys=bool((keys < lens).any()),
                )
            )
        return tuple(groups)

    def per_group(
        self, fn: Callable[..., torch.Tensor], *xs: torch.Tensor, groups: tuple[LengthGroup, ...] | None = None
    ) -> torch.Tensor:
        """`fn(group, *rows)` for each length group (`groups`, default `self.groups`), on that
        group's rows of each packed `[T, ...]` tensor in `xs`; the results `[Tg, ...]` are put back
        in packed order `[T, ...]`."""
        groups = self.groups if groups is None else groups
        if len(groups) == 1:  # the group is the batch, in packed order
            return fn(groups[0], *xs)
        out = None
        for g in groups:
            rows = fn(g, *(x.index_select(0, g.tokens) for x in xs))
            if out is None:
                out = rows.new_empty(xs[0].shape[0], *rows.shape[1:])
            out.index_copy_(0, g.tokens, rows)
        assert out is not None  # groups is never empty
        return out

    @classmethod
    def build(
        cls,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        key_lengths: torch.Tensor | None = None,
        each: bool = True,
        row_block_bytes: int = 0,
        host_cu_seqlens: np.ndarray | None = None,
        num_tokens: int | None = None,
        whole: bool = False,
    ) -> AttentionMeta:
        """`key_lengths` `[n]`: keys per sequence (see the class), None when every token is one;
        `each`: whether the CPU "each" path may be taken; `row_block_bytes`: see the class;
        `host_cu_seqlens`: the same boundaries on the host, when the caller has them (no device
        read-back then: the token count and `bounds` come from them); `num_tokens`: the token
        count alone (a captured forward's: its bounds change from replay to replay); `whole`: see
        the class."""
        device = cu_seqlens.device
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [n]
        n = lengths.numel()
        host = None if host_cu_seqlens is None else tuple(int(b) for b in host_cu_seqlens)
        # With the total known, repeat_interleave does not read `lengths` back from the device.
        total = num_tokens if host is None else host[-1]
        seq_index = torch.repeat_interleave(torch.arange(n, device=device), lengths, output_size=total)  # [T]
        starts = cu_seqlens[:-1].long()[seq_index]  # [T]
        pos_in_seq = torch.arange(seq_index.numel(), device=device) - starts
        key_mask = torch.arange(max_seqlen, device=device)[None, :] < lengths[:, None]  # [n, L]
        return cls(
            cu_seqlens, max_seqlen, seq_index, pos_in_seq, key_mask, key_lengths, each, row_block_bytes, host, whole
        )


# Padding and unpadding move whole rows through one flat slot index (index_copy_ / index_select):
# on CPU these run 3-5x faster than the same moves written as two-index advanced indexing
# (`out[seq, pos] = x`, `x[seq, pos]`), which took ~7 % of a MiniLM forward.
def _scatter_rows(x: torch.Tensor, slots: torch.Tensor, n: int, length: int, width: int | None = None) -> torch.Tensor:
    """Rows `[R, ..., D]` -> `[n, length, ..., width]`: row r at flat slot `slots[r]`, zeros elsewhere
    (and in channels past D)."""
    widened = width is not None and width != x.shape[-1]
    if widened:
        assert width is not None
        out = x.new_zeros(n * length, *x.shape[1:-1], width)
    else:
        out = x.new_zeros(n * length, *x.shape[1:])
    (out[..., : x.shape[-1]] if widened else out).index_copy_(0, slots, x)
    return out.view(n, length, *out.shape[1:])


def _gather_rows(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[n, length, ...]` -> the rows at flat slots `slots` `[R, ...]`. A non-contiguous `x` (a
    transposed view) is copied whole by the reshape first; still cheaper than two-index gathers."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, slots)
