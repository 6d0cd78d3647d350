"""Variable-length attention over packed sequences: the one seam where kernels are chosen.

Inputs are packed: q `[T, H, D]`, k and v `[T, Hkv, D]` (Hkv divides H: grouped-query attention),
sequence boundaries in `cu_seqlens` `[n+1]` (int32, cumulative). Every architecture's attention is a
call of `varlen_attention`; what differs between them is data: `causal`, a `window`, a `scale`,
and a `ScoreBias`, an additive score term beside q.k (MPNet's relative-position table as a
`PositionBias`; DeBERTa's disentangled c2p/p2c terms, which read q and k, as its own). Model files
never pick a kernel or test a device. Three kernels (`attention_path`, the one place that chooses,
by device, dtype, flash-attn's presence and the call's masking, says which a call takes):

- flash-attn's `flash_attn_varlen_func` on CUDA in fp16/bf16 when the package is installed: it
  reads the packed layout directly, no padding and no mask anywhere.
- on CPU in float32, full attention (no causal or window mask, no bias, no key cut, no grouped-query
  heads) over sequences of unequal lengths, none past EACH_MAX_SEQLEN: each sequence on its own, as
  two batched matmuls over its heads and a softmax, read straight from the packed rows (views, no
  padding, no mask, no gather). Padded groups pay for their padding, their key mask and their
  gathers, and for head dims of 32-64 the matmuls outrun the fused CPU kernel (docs/benchmarks.md,
  CPU kernels). Past ~512
  tokens the `[H, L, L]` scores cost more than the fused kernel saves, and sequences all of one
  length need no padding at all: those take the padded path below. Whether it wins depends on the
  CPU's kernels, so a card's `batching.attention: padded` (e.g. from `shoal tune`) turns it off.
- elsewhere, `scaled_dot_product_attention` over padded `[n, H, L, D]` views that exist only
  inside this function: tokens are scattered into them and gathered back, so the layers around
  attention never see a pad token. Sequences are grouped by length (`AttentionMeta.groups`) and
  each group is padded only to its own longest, so a batch mixing short and long texts does not
  pay L_max² for every sequence.

Keys can be fewer than tokens: `AttentionMeta.key_lengths` `[n]` says that only the first
`key_lengths[i]` tokens of sequence i are attended to, though every token is still a query (ColBERT's
query expansion: [MASK] tokens read the query but nothing reads them). Those batches always take the
padded path, where it is one more key mask (for causal attention, which otherwise needs none, one
`[ng, 1, Lg, Lg]` mask per group).

Masks on the padded path are built once per forward and length group (cached on the group), never
per layer, and no `[L, L]` mask is ever copied per sequence: causal attention passes `is_causal`
(right padding keeps every real query off the pad keys, so no mask at all); full attention gets
an `[ng, 1, 1, Lg]` key mask; a window is one `[1, 1, Lg, Lg]` band shared by the group; a shared
score bias is `[1, H, Lg, Lg]` (a position bias: a view of the caller's `[H, L, L]`), a per-sequence
one `[ng, H, Lg, Lg]`, built by the bias for each group from its padded q and k. Where a shared band
or bias meets padding, pad keys are dropped by one extra key channel instead (`_sdpa_group`); a
per-sequence bias gets -inf written at its pad keys. Masks are additive, in the query's dtype: that
is what the kernels consume; a bool mask would be converted to one (and its negation made) on every
call, which costs more than the float mask it saves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
import torch.nn.functional as F

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
        """`cu_seqlens` as Python ints (read once per forward)."""
        return self.cu_seqlens.tolist()

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
        key = (ratio, slack)
        cache = self.__dict__.setdefault("_groups_within", {})
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
    ) -> AttentionMeta:
        """`key_lengths` `[n]`: keys per sequence (see the class), None when every token is one;
        `each`: whether the CPU "each" path may be taken; `row_block_bytes`: see the class."""
        device = cu_seqlens.device
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [n]
        n = lengths.numel()
        seq_index = torch.repeat_interleave(torch.arange(n, device=device), lengths)  # [T]
        starts = cu_seqlens[:-1].long()[seq_index]  # [T]
        pos_in_seq = torch.arange(seq_index.numel(), device=device) - starts
        key_mask = torch.arange(max_seqlen, device=device)[None, :] < lengths[:, None]  # [n, L]
        return cls(cu_seqlens, max_seqlen, seq_index, pos_in_seq, key_mask, key_lengths, each, row_block_bytes)


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


class ScoreBias(Protocol):
    """An additive term in the attention scores: softmax(scale * q.k + bias) within each sequence.

    The padded path asks it for each length group's bias; no other kernel takes one, so a call with
    a bias runs padded.
    """

    @property
    def shared(self) -> bool:
        """True: one bias serves every sequence of a group, `[1, H, Lg, Lg]`, and may be a view the
        seam never writes to. False: `[ng, H, Lg, Lg]`, one per sequence, fresh: the seam writes
        -inf at its padding keys in place."""
        ...

    @property
    def grouping(self) -> tuple[float, int]:
        """(ratio, slack) of the length groups it is computed over (`AttentionMeta.groups_within`)."""
        ...

    def for_group(self, g: LengthGroup, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The bias for group `g`, in q's dtype, from its padded q `[ng, H, Lg, D]` and k
        `[ng, Hkv, Lg, D]` (zeros at padding)."""
        ...


@dataclass(frozen=True)
class PositionBias:
    """A `ScoreBias` of positions only, the same for every sequence (MPNet's relative-position
    buckets): `table` `[H, L, L]` over positions 0..L-1 (L >= the batch's longest), built once per
    forward; each length group reads its top-left `[H, Lg, Lg]` corner, a view."""

    table: torch.Tensor  # [H, L, L]
    shared: ClassVar[bool] = True
    grouping: ClassVar[tuple[float, int]] = (GROUP_RATIO, GROUP_SLACK)

    def for_group(self, g: LengthGroup, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.table[None, :, : g.max_seqlen, : g.max_seqlen]  # [1, H, Lg, Lg]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    bias: ScoreBias | torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each packed sequence. Returns `[T, H, D]`.

    `causal`: a token sees only earlier tokens of its sequence. `window` = (left, right): a token at
    position i sees positions i-left..i+right only (local attention, as ModernBERT's local layers).
    `scale`: multiplies q.k (default D ** -0.5). `bias`: an additive score term (`ScoreBias`); a
    tensor `[H, L, L]` is read as a `PositionBias`. A bias forces the padded path and excludes
    `causal` and `window`.

    Keys past `meta.key_lengths` are attended by no query (any of the masks above still applies).
    """
    if bias is not None and (causal or window is not None):
        raise ValueError("varlen_attention takes a position bias or causal/window masking, not both")
    if isinstance(bias, torch.Tensor):
        bias = PositionBias(bias)
    # Batches with short key lengths (ColBERT queries: a few, of ~32 tokens) take the padded path:
    # flash-attn could read them only through a second, gathered k/v layout with its own
    # cu_seqlens_k, and only without causal or window masking, which it aligns differently when
    # query and key lengths differ. Not worth a second layout for batches this small.
    path = attention_path(q, k, meta, causal=causal, window=window, bias=bias)
    if path == "flash":
        return _flash(q, k, v, meta, causal, scale, window)
    if path == "each":
        return _attend_each(q, k, v, meta, scale)
    attend = functools.partial(_sdpa_group, causal=causal, scale=scale, window=window, bias=bias)
    return meta.per_group(attend, q, k, v, groups=None if bias is None else meta.groups_within(*bias.grouping))


# The longest sequence the "each" path takes (see the module).
EACH_MAX_SEQLEN = 512


def attention_path(
    q: torch.Tensor,
    k: torch.Tensor,
    meta: AttentionMeta,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    bias: ScoreBias | torch.Tensor | None = None,
) -> str:
    """Which kernel `varlen_attention` runs for these arguments: "flash", "each" or "padded"."""
    if bias is None and meta.key_lengths is None and flash_available(q.device, q.dtype):
        return "flash"
    if (
        meta.each
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and not causal
        and window is None
        and bias is None
        and meta.key_lengths is None
        and k.shape[1] == q.shape[1]
        and meta.max_seqlen <= EACH_MAX_SEQLEN
        and not meta.uniform
    ):
        return "each"
    return "padded"


def _attend_each(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, scale: float | None
) -> torch.Tensor:
    """Full attention, one sequence at a time, on views of the packed rows: `[T, H, D]`."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    bounds = meta.bounds
    for start, stop in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[start:stop].transpose(0, 1) for x in (q, k, v))  # [H, L, D] views
        weights = torch.matmul(qs, ks.transpose(1, 2)).mul_(scale).softmax(-1)  # [H, L, L]
        out[start:stop] = torch.matmul(weights, vs).transpose(0, 1)
    return out


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether attention on `device` in `dtype` runs flash-attn's varlen kernel (when the call has no
    score bias and no key cut): CUDA, float16 or bfloat16, and `flash_attn` installed. That kernel
    keeps no `[n, H, L, L]` score matrix, which the runner's workspace estimate reads from here."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None


@functools.cache
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flash(q, k, v, meta: AttentionMeta, causal: bool, scale: float | None, window) -> torch.Tensor:
    return _flash_varlen()(
        q,
        k,
        v,
        cu_seqlens_q=meta.cu_seqlens,
        cu_seqlens_k=meta.cu_seqlens,
        max_seqlen_q=meta.max_seqlen,
        max_seqlen_k=meta.max_seqlen,
        softmax_scale=scale,
        causal=causal,
        window_size=window or (-1, -1),
    )


def _sdpa_group(
    g: LengthGroup, q, k, v, *, causal: bool, scale: float | None, window, bias: ScoreBias | None
) -> torch.Tensor:
    """Attention over one length group's padded view: q `[Tg, H, D]`, k/v `[Tg, Hkv, D]` -> `[Tg, H, D]`."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    # A mask shared by the group's sequences cannot hide each one's padding keys. One extra channel
    # does: 1 in every query, a huge negative in pad keys (0 in real ones), so a pad key's score
    # underflows to a zero weight and a real key's score is unchanged. Finite (a quarter of the
    # dtype's largest), so a pad query whose window holds only pad keys still gets no NaN.
    # Causal attention needs none of this, unless keys stop before a sequence's end.
    shared = window is not None or (bias is not None and bias.shared)
    drop_pad_keys = shared and g.key_mask is not None and (not causal or g.cuts_keys)
    width = (D // 8 + 1) * 8 if drop_pad_keys else D  # kernels like head dims in multiples of 8
    qp, kp, vp = (g.pad(x, width).transpose(1, 2) for x in (q, k, v))  # [ng, h, Lg, width]
    if bias is None:
        mask = g.attention_mask(causal, window, q.dtype)  # None, [1, 1, Lg, Lg] or [ng, 1, 1, Lg]
    else:
        mask = bias.for_group(g, qp[..., :D], kp[..., :D])  # [1, H, Lg, Lg] or [ng, H, Lg, Lg]
        if not bias.shared and g.key_mask is not None:  # a fresh per-sequence bias: pad keys -inf
            mask = mask.masked_fill_(~g.key_mask[:, None, None, :], float("-inf"))
    if drop_pad_keys:
        assert g.key_mask is not None  # drop_pad_keys asks for it
        qp[..., D] = 1.0
        kp[..., D].masked_fill_(~g.key_mask[:, None, :], -torch.finfo(q.dtype).max / 4)
    if Hkv != H:  # grouped-query attention: each kv head serves H // Hkv query heads
        kp = kp.repeat_interleave(H // Hkv, dim=1)
        vp = vp.repeat_interleave(H // Hkv, dim=1)
    out = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=mask, is_causal=causal and mask is None, scale=scale if scale is not None else D**-0.5
    )  # [ng, H, Lg, width]
    return g.unpad(out[..., :D].transpose(1, 2))  # [Tg, H, D]
