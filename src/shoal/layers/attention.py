"""Variable-length attention over packed sequences: the one seam where kernels are chosen.

Inputs are packed: q `[T, H, D]`, k and v `[T, Hkv, D]` (Hkv divides H: grouped-query attention),
sequence boundaries in `cu_seqlens` `[n+1]` (int32, cumulative). Two kernels:

- flash-attn's `flash_attn_varlen_func` on CUDA in fp16/bf16 when the package is installed: it
  reads the packed layout directly, no padding anywhere.
- elsewhere, `scaled_dot_product_attention` over padded `[n, H, L, D]` views that exist only
  inside this function: tokens are scattered into them and gathered back, so the layers around
  attention never see a pad token. Masked keys never contribute. Sequences are grouped by length
  (`AttentionMeta.groups`) and each group is padded only to its own longest, so a batch mixing
  short and long texts does not pay L_max² for every sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import numpy as np

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LengthGroup:
    """Sequences of similar length, padded together: token `tokens[i]` of the packed batch sits at
    (seq_index[i], pos_in_seq[i]) of this group's `[num_seqs, max_seqlen]` view."""

    tokens: torch.Tensor  # [Tg] int64 indices into the packed batch
    seq_index: torch.Tensor  # [Tg]
    pos_in_seq: torch.Tensor  # [Tg]
    key_mask: torch.Tensor | None  # [ng, Lg] bool; None when every sequence fills the view
    num_seqs: int
    max_seqlen: int


@dataclass(frozen=True)
class AttentionMeta:
    """Boundaries of the packed batch, built once per forward and passed to every layer."""

    cu_seqlens: torch.Tensor  # [n+1] int32, on the model's device
    max_seqlen: int
    # For the padded path: token t lives at (seq_index[t], pos_in_seq[t]) of [n, L].
    seq_index: torch.Tensor  # [T] int64
    pos_in_seq: torch.Tensor  # [T] int64
    key_mask: torch.Tensor  # [n, L] bool, True where a real token is

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed `[T, ...]` -> padded `[n, L, ...]` (zeros where no token is)."""
        out = x.new_zeros(self.num_seqs, self.max_seqlen, *x.shape[1:])
        out[self.seq_index, self.pos_in_seq] = x
        return out

    def additive_mask(self, bias: torch.Tensor) -> torch.Tensor:
        """A per-position score bias `[H, L, L]` -> `[n, H, L, L]` with -inf at padding keys.

        Build it once per forward and pass it as `bias` to every layer's attention.
        """
        return torch.where(self.key_mask[:, None, None, :], bias[None], float("-inf"))

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded `[n, L, ...]` -> packed `[T, ...]`."""
        return x[self.seq_index, self.pos_in_seq]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @cached_property
    def groups(self) -> tuple[LengthGroup, ...]:
        """Sequences sorted by length and cut where the length more than doubles (and grows by
        more than 32 tokens): each group pads to at most about twice its shortest member."""
        bounds = self.cu_seqlens.cpu().numpy().astype(np.int64)
        lengths = np.diff(bounds)
        order = np.argsort(lengths, kind="stable")
        cuts, first = [], int(lengths[order[0]])
        for rank, seq in enumerate(order):
            if lengths[seq] > max(2 * first, first + 32):
                cuts.append(rank)
                first = int(lengths[seq])
        groups = []
        for members in np.split(order, cuts):
            lens = lengths[members]
            tokens = np.concatenate([np.arange(bounds[m], bounds[m + 1]) for m in members])
            seq_index = np.repeat(np.arange(len(members)), lens)
            pos_in_seq = tokens - np.repeat(bounds[members], lens)
            L = int(lens.max())
            mask = None if lens.min() == L else torch.from_numpy(np.arange(L)[None, :] < lens[:, None])
            to = dict(device=self.cu_seqlens.device)
            groups.append(LengthGroup(
                torch.from_numpy(tokens).to(**to), torch.from_numpy(seq_index).to(**to),
                torch.from_numpy(pos_in_seq).to(**to), mask.to(**to) if mask is not None else None,
                len(members), L,
            ))
        return tuple(groups)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, max_seqlen: int) -> "AttentionMeta":
        device = cu_seqlens.device
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [n]
        n = lengths.numel()
        seq_index = torch.repeat_interleave(torch.arange(n, device=device), lengths)  # [T]
        starts = cu_seqlens[:-1].long()[seq_index]  # [T]
        pos_in_seq = torch.arange(seq_index.numel(), device=device) - starts
        key_mask = torch.arange(max_seqlen, device=device)[None, :] < lengths[:, None]  # [n, L]
        return cls(cu_seqlens, max_seqlen, seq_index, pos_in_seq, key_mask)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each packed sequence. Returns `[T, H, D]`.

    `causal`: a token sees only earlier tokens of its sequence. `window` = (left, right): a token at
    position i sees positions i-left..i+right only (local attention, as ModernBERT's local layers).
    `bias`: an additive score bias `[H, L, L]` over positions 0..L-1 (L = meta.max_seqlen), the
    same for every sequence (relative-position biases, as MPNet's), or that bias already combined
    with the padding mask by `meta.additive_mask` (`[n, H, L, L]`). It forces the padded path.
    """
    if bias is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None:
        return _flash(q, k, v, meta, causal, scale, window)
    return _padded_sdpa(q, k, v, meta, causal, scale, window, bias)


@functools.cache
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flash(q, k, v, meta: AttentionMeta, causal: bool, scale: float | None, window) -> torch.Tensor:
    return _flash_varlen()(
        q, k, v,
        cu_seqlens_q=meta.cu_seqlens, cu_seqlens_k=meta.cu_seqlens,
        max_seqlen_q=meta.max_seqlen, max_seqlen_k=meta.max_seqlen,
        softmax_scale=scale, causal=causal, window_size=window or (-1, -1),
    )


def _padded_sdpa(q, k, v, meta: AttentionMeta, causal: bool, scale: float | None, window, bias=None) -> torch.Tensor:
    if bias is None and len(meta.groups) > 1:
        out = torch.empty_like(q)
        for g in meta.groups:
            out[g.tokens] = _sdpa_group(q[g.tokens], k[g.tokens], v[g.tokens], g, causal, scale, window)
        return out
    return _sdpa_group(q, k, v, meta, causal, scale, window, bias)


def _sdpa_group(q, k, v, g, causal: bool, scale: float | None, window, bias=None) -> torch.Tensor:
    """Attention over one padded view; `g` is the whole batch (AttentionMeta) or a LengthGroup."""
    L = g.max_seqlen
    H, Hkv = q.shape[1], k.shape[1]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [t, h, D] -> [n, h, L, D]
        out = x.new_zeros(g.num_seqs, L, *x.shape[1:])
        out[g.seq_index, g.pos_in_seq] = x
        return out.transpose(1, 2)

    qp, kp, vp = pad(q), pad(k), pad(v)
    if Hkv != H:  # grouped-query attention: each kv head serves H // Hkv query heads
        kp = kp.repeat_interleave(H // Hkv, dim=1)
        vp = vp.repeat_interleave(H // Hkv, dim=1)
    if bias is not None and bias.dim() == 4:  # already the full additive mask
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=bias, scale=scale)
        return out.transpose(1, 2)[g.seq_index, g.pos_in_seq]
    mask = g.key_mask[:, None, None, :] if g.key_mask is not None else None  # [n, 1, 1, L]
    if causal or window is not None:
        offset = torch.arange(L, device=q.device)[None, :] - torch.arange(L, device=q.device)[:, None]  # j - i
        allowed = torch.ones(L, L, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= offset <= 0
        if window is not None:
            allowed &= (offset >= -window[0]) & (offset <= window[1])
        mask = allowed[None, None] if mask is None else mask & allowed[None, None]  # [n, 1, L, L]
    if bias is not None:  # additive float mask: -inf where masked, the bias elsewhere
        keep = mask if mask is not None else torch.ones((), dtype=torch.bool, device=q.device)
        mask = torch.where(keep, bias[None].to(q.dtype), float("-inf"))  # [n, H, L, L]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)  # [n, H, L, D]
    return out.transpose(1, 2)[g.seq_index, g.pos_in_seq]  # [t, H, D]
