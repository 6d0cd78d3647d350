"""Per-sequence key lengths in `varlen_attention` (ColBERT's query expansion: every token is a query, only
the first `key_lengths[i]` tokens of sequence i are keys), against torch's own attention run on each
sequence with an explicit boolean mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.layers import AttentionMeta, varlen_attention

LENGTHS = [12, 3, 40, 12, 90, 7]  # more than one length group on the padded path
KEY_LENGTHS = [8, 3, 40, 5, 61, 7]  # some sequences attend to all their tokens, some not


def allowed_keys(L: int, num_keys: int, causal: bool, window) -> torch.Tensor:
    """`[L, L]` bool: query i may read key j."""
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    allowed = (j < num_keys).expand(L, L)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (j >= i - window[0]) & (j <= i + window[1])
    return allowed


def reference(q, k, v, num_keys: int, causal: bool, window, bias) -> torch.Tensor:
    """One sequence, q `[L, H, D]`, k/v `[L, Hkv, D]`, through F.scaled_dot_product_attention."""
    L, H = q.shape[0], q.shape[1]
    allowed = allowed_keys(L, num_keys, causal, window)
    mask = torch.zeros(H, L, L).masked_fill(~allowed, float("-inf"))
    if bias is not None:
        mask = mask + bias[:, :L, :L]
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [h, L, D]
    return F.scaled_dot_product_attention(
        qh[None], kh[None], vh[None], attn_mask=mask[None], enable_gqa=kh.shape[0] != H
    )[0].transpose(0, 1)


@pytest.mark.parametrize(
    "masking",
    [{}, {"causal": True}, {"window": (3, 2)}, {"causal": True, "window": (4, 0)}, {"bias": True}],
    ids=["full", "causal", "window", "causal-window", "bias"],
)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_tokens_past_a_sequences_key_length_are_attended_by_no_query(masking, heads):
    torch.manual_seed(0)
    H, Hkv = heads
    T, D, L = sum(LENGTHS), 16, max(LENGTHS)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    masking = dict(masking)  # the parameter is shared between runs
    bias = torch.randn(H, L, L) if masking.pop("bias", False) else None
    if bias is not None:
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # bias: no GQA needed
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    meta = AttentionMeta.build(cu, L, torch.tensor(KEY_LENGTHS, dtype=torch.int32))
    assert len(meta.groups) > 1
    out = varlen_attention(q, k, v, meta, bias=bias, **masking)
    assert torch.isfinite(out).all()
    plain = varlen_attention(q, k, v, AttentionMeta.build(cu, L), bias=bias, **masking)
    causal, window = masking.get("causal", False), masking.get("window")
    for start, end, num_keys in zip(cu[:-1].tolist(), cu[1:].tolist(), KEY_LENGTHS):
        expected = reference(q[start:end], k[start:end], v[start:end], num_keys, causal, window, bias)
        # A query whose window holds no key at all has no defined output (it stays finite, above).
        sees_a_key = allowed_keys(end - start, num_keys, causal, window).any(dim=1)
        assert (out[start:end] - expected)[sees_a_key].abs().max().item() <= 1e-5
        if num_keys < end - start and not causal:  # the key length changed this sequence's output
            assert (out[start:end] - plain[start:end]).abs().max().item() > 1e-3
