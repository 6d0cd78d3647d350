"""Variable-length attention over packed sequences: the one seam where kernels are chosen.

Inputs are packed: q `[T, H, D]`, k and v `[T, Hkv, D]` (Hkv divides H: grouped-query attention),
sequence boundaries in `AttentionMeta` (layers/attention_meta.py: `cu_seqlens` `[n+1]`, int32,
cumulative). Every architecture's attention is a call of `varlen_attention`; what differs between
them is data: `causal`, a `window`, a `scale`, and a `ScoreBias`, an additive score term beside
q.k (MPNet's relative-position table as a `PositionBias`; DeBERTa's disentangled c2p/p2c terms,
which read q and k, as its own). Model files never pick a kernel or test a device. Three kernels
(`attention_path`, the one place that chooses, by device, dtype, flash-attn's presence and the
call's masking, says which a call takes):

- flash-attn's `flash_attn_varlen_func` on CUDA in fp16/bf16 when the package is installed: it
  reads the packed layout directly, no padding and no mask anywhere.
- on CPU in float32, full attention (no causal or window mask, no key cut, no grouped-query heads;
  no bias but a `PositionBias`) over sequences of unequal lengths, none past EACH_MAX_SEQLEN: each
  sequence on its own, as two batched matmuls over its heads and a softmax, read straight from the
  packed rows (views, no padding, no mask, no gather); a position bias is the first matmul's
  addend, its table's top-left corner (MPNet). Padded groups pay for their padding, their key mask and their
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

On the padded path each length group's mask comes from the group (`LengthGroup.attention_mask`,
built once per forward); a shared score bias is `[1, H, Lg, Lg]` (a position bias: a view of the
caller's `[H, L, L]`), a per-sequence one `[ng, H, Lg, Lg]`, built by the bias for each group from its
padded q and k. Where a shared band or bias meets padding, pad keys are dropped by one extra key
channel instead (`_sdpa_group`); a per-sequence bias gets -inf written at its pad keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

# LengthGroup is what a `ScoreBias` is handed: a model's bias imports it from here, beside the protocol.
from .attention_meta import GROUP_RATIO, GROUP_SLACK, AttentionMeta, LengthGroup


class ScoreBias(Protocol):
    """An additive term in the attention scores: softmax(scale * q.k + bias) within each sequence.

    The padded path asks it for each length group's bias; of the other kernels only the CPU's "each"
    takes one, and only a `PositionBias`, so a call with any other bias runs padded.
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
        return _attend_each(q, k, v, meta, scale, bias if isinstance(bias, PositionBias) else None)
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
        and (bias is None or isinstance(bias, PositionBias))
        and meta.key_lengths is None
        and k.shape[1] == q.shape[1]
        and meta.max_seqlen <= EACH_MAX_SEQLEN
        and not meta.uniform
    ):
        return "each"
    return "padded"


def _attend_each(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    scale: float | None,
    bias: PositionBias | None = None,
) -> torch.Tensor:
    """Full attention, one sequence at a time, on views of the packed rows: `[T, H, D]`; a position
    bias's `[H, L, L]` corner is added to each sequence's scores."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    bounds = meta.bounds
    for start, stop in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[start:stop].transpose(0, 1) for x in (q, k, v))  # [H, L, D] views
        if bias is None:
            scores = torch.matmul(qs, ks.transpose(1, 2)).mul_(scale)  # [H, L, L]
        else:
            n = stop - start
            scores = torch.baddbmm(bias.table[:, :n, :n], qs, ks.transpose(1, 2), alpha=scale)  # [H, L, L]
        weights = scores.softmax(-1)
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
