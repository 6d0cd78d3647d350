"""The shared layers against straightforward per-sequence references."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from shoal.catalog.card import ROW_BLOCK_BYTES
from shoal.layers import AttentionMeta, RMSNorm, Rotary, apply_rotary, in_row_blocks, varlen_attention
from shoal.layers.attention import EACH_MAX_SEQLEN, PositionBias, attention_path
from shoal.layers.rows import MIN_BLOCK_ROWS, block_rows

LENGTHS = [5, 1, 17, 9, 32, 70, 40]  # two length groups in the padded CPU path


def naive_attention(q, k, v, causal, window, bias=None):
    """One sequence: q [L, H, D], k/v [L, Hkv, D], explicit softmax over allowed keys."""
    L, H, D = q.shape
    groups = H // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(D)
    if bias is not None:
        scores = scores + bias[:, :L, :L]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    allowed = torch.ones(L, L, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= (j >= i - window[0]) & (j <= i + window[1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window", [None, (3, 3), (4, 0)], ids=["global", "window-3-3", "window-4-0"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_varlen_attention_equals_per_sequence_attention(causal, window, heads):
    torch.manual_seed(0)
    H, Hkv = heads
    T, D = sum(LENGTHS), 16
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    out = varlen_attention(q, k, v, AttentionMeta.build(cu, max(LENGTHS)), causal=causal, window=window)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expected = naive_attention(q[start:end], k[start:end], v[start:end], causal, window)
        assert (out[start:end] - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "lengths, path",
    [
        (LENGTHS, "each"),  # unequal, all short: one sequence at a time
        ([23, 23, 23], "padded"),  # all of one length: one padded group, no padding in it
        ([7, EACH_MAX_SEQLEN + 1, 40, 300], "padded"),  # one past the "each" bound: padded length groups
    ],
    ids=["each", "uniform", "long"],
)
def test_each_cpu_attention_path_equals_per_sequence_attention(lengths, path):
    """Full float32 attention on CPU takes the path its lengths call for, and every path agrees
    with the straightforward per-sequence softmax."""
    torch.manual_seed(1)
    T, H, D = sum(lengths), 4, 16
    q, k, v = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, H, D)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    meta = AttentionMeta.build(cu, max(lengths))
    assert attention_path(q, k, meta) == path
    assert attention_path(q, k, meta, causal=True) == "padded"  # masks of any kind stay on the padded path
    assert attention_path(q.double(), k.double(), meta) == "padded"  # float32 only
    out = varlen_attention(q, k, v, meta, scale=0.3 if path == "each" else None)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expected = naive_attention(
            q[start:end] * (0.3 * math.sqrt(D) if path == "each" else 1.0), k[start:end], v[start:end], False, None
        )
        assert (out[start:end] - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("path", ["each", "padded"])
@pytest.mark.parametrize("extra_positions", [0, 9], ids=["bias-of-the-longest", "longer-bias"])
def test_varlen_attention_adds_a_relative_position_bias_per_sequence(extra_positions, path):
    torch.manual_seed(0)
    H, T, D, L = 4, sum(LENGTHS), 8, max(LENGTHS)
    q, k, v = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, H, D)
    Lb = L + extra_positions  # a bias may cover more positions than the batch uses
    relative = torch.arange(Lb)[None, :] - torch.arange(Lb)[:, None]  # j - i
    bias = torch.randn(H, 2 * Lb - 1)[:, relative + Lb - 1]  # [H, Lb, Lb], a function of j - i only
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    meta = AttentionMeta.build(cu, L, each=path == "each")
    assert attention_path(q, k, meta, bias=PositionBias(bias)) == path  # float32 on a CPU: each, unless turned off
    out = varlen_attention(q, k, v, meta, bias=bias)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expected = naive_attention(q[start:end], k[start:end], v[start:end], False, None, bias)
        assert (out[start:end] - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["window", "bias"])
def test_padding_keys_stay_unseen_under_a_shared_mask_in_half_precision(dtype, kind):
    # A window or a bias is one mask for a whole length group; padding keys are dropped through an
    # extra key channel whose magnitude must stay finite and decisive in 16-bit floats too.
    torch.manual_seed(0)
    H, T, D, L = 4, sum(LENGTHS), 16, max(LENGTHS)
    q, k, v = torch.randn(T, H, D) * 3, torch.randn(T, H, D) * 3, torch.randn(T, H, D)
    relative = torch.arange(L)[None, :] - torch.arange(L)[:, None]
    bias = torch.randn(H, 2 * L - 1)[:, relative + L - 1] if kind == "bias" else None
    window = (3, 3) if kind == "window" else None
    q, k, v, bias = (x.to(dtype) if x is not None else None for x in (q, k, v, bias))
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    out = varlen_attention(q, k, v, AttentionMeta.build(cu, L), window=window, bias=bias).float()
    assert torch.isfinite(out).all()
    q, k, v, bias = (x.float() if x is not None else None for x in (q, k, v, bias))  # the same rounded inputs
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expected = naive_attention(q[start:end], k[start:end], v[start:end], False, window, bias)
        assert (out[start:end] - expected).abs().max().item() <= 0.02


def test_a_position_bias_with_causal_or_windowed_attention_is_refused():
    q = torch.randn(4, 2, 8)
    meta = AttentionMeta.build(torch.tensor([0, 4], dtype=torch.int32), 4)
    for masking in (dict(causal=True), dict(window=(1, 1))):
        with pytest.raises(ValueError, match="not both"):
            varlen_attention(q, q, q, meta, bias=torch.zeros(2, 4, 4), **masking)


@dataclass(frozen=True)
class ContentBias:
    """A per-sequence score bias that reads q and k, as DeBERTa's c2p/p2c terms do:
    bias[i, j] = weight * sum(q_i) * sum(k_j), per head."""

    weight: float
    shared: ClassVar[bool] = False
    grouping: ClassVar[tuple[float, int]] = (1.25, 4)  # tighter groups than the default

    def for_group(self, g, q, k):  # q, k [ng, H, Lg, D] -> [ng, H, Lg, Lg], fresh
        return self.weight * q.sum(-1)[..., :, None] * k.sum(-1)[..., None, :]


def test_a_per_sequence_score_bias_reading_q_and_k_equals_per_sequence_attention():
    """The seam hands a `ScoreBias` each group's padded q and k, adds its terms, and keeps every
    padding key unseen though the bias gives it a finite score."""
    torch.manual_seed(0)
    H, T, D, L = 4, sum(LENGTHS), 16, max(LENGTHS)
    q, k, v = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, H, D)
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    meta = AttentionMeta.build(cu, L)
    bias = ContentBias(0.05)
    assert attention_path(q, k, meta, bias=bias) == "padded"
    assert len(meta.groups_within(*bias.grouping)) > len(meta.groups)  # its own, tighter grouping
    out = varlen_attention(q, k, v, meta, bias=bias)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks = q[start:end], k[start:end]
        expected_bias = 0.05 * qs.sum(-1).T[:, :, None] * ks.sum(-1).T[:, None, :]  # [H, n, n]
        expected = naive_attention(qs, ks, v[start:end], False, None, expected_bias)
        assert (out[start:end] - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("partial", [False, True], ids=["full-rotary", "partial-rotary"])
def test_rotary_matches_transformers_llama(partial):
    torch.manual_seed(0)
    head_dim, base = 32, 10000.0
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, rope_theta=base, max_position_embeddings=256)
    rope = LlamaRotaryEmbedding(config)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])  # packed: restarts per sequence
    x = torch.randn(positions.numel(), 4, head_dim)

    rotary_dim = head_dim // 2 if partial else head_dim
    cos, sin = Rotary(head_dim, base, rotary_dim).cos_sin(positions, x.dtype)
    ours = apply_rotary(x, cos, sin)

    if partial:  # transformers' partial rotary: rotate the first rotary_dim channels, keep the rest
        ref_cos, ref_sin = _reference_cos_sin(positions, rotary_dim, base)
        rot, _ = apply_rotary_pos_emb(
            x[None, ..., :rotary_dim].transpose(1, 2), x[None, ..., :rotary_dim].transpose(1, 2), ref_cos, ref_sin
        )
        expected = torch.cat((rot[0].transpose(0, 1), x[..., rotary_dim:]), dim=-1)
    else:
        ref_cos, ref_sin = rope(x[None], positions[None])
        rot, _ = apply_rotary_pos_emb(x[None].transpose(1, 2), x[None].transpose(1, 2), ref_cos, ref_sin)
        expected = rot[0].transpose(0, 1)
    assert (ours - expected).abs().max().item() <= 1e-5


def _reference_cos_sin(positions, dim, base):
    config = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, rope_theta=base, max_position_embeddings=256)
    return LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])


def test_rmsnorm_matches_transformers_llama():
    torch.manual_seed(0)
    ref = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.2)
    ours = RMSNorm(64, eps=1e-6)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(10, 64) * 3
    assert (ours(x) - ref(x)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("num_rows", [1, 64, 65, 200, 513])
def test_row_blocks_give_what_one_call_gives_and_split_by_the_intermediates_bytes(num_rows):
    g = torch.Generator().manual_seed(3)
    w_in, w_out = torch.randn(16, 96, generator=g), torch.randn(96, 16, generator=g)
    x = torch.randn(num_rows, 16, generator=g)
    calls = []

    def ffn(rows: torch.Tensor) -> torch.Tensor:  # per row, with a norm: what a layer's FFN does
        calls.append(rows.shape[0])
        return torch.nn.functional.layer_norm(rows + torch.relu(rows @ w_in) @ w_out, (16,))

    whole = ffn(x)
    calls.clear()
    blocked = in_row_blocks(ffn, x, 96, block_bytes=64 * 96 * 4)  # 64 rows of a 96-wide float32 intermediate
    assert blocked.shape == whole.shape and blocked.dtype == whole.dtype
    assert torch.allclose(blocked, whole, atol=1e-5)
    assert calls == [min(64, num_rows - start) for start in range(0, num_rows, 64)]
    calls.clear()
    assert torch.equal(in_row_blocks(ffn, x, 96, block_bytes=0), whole) and calls == [num_rows]
    assert block_rows(1536, ROW_BLOCK_BYTES) == 512 and block_rows(3072, ROW_BLOCK_BYTES) == 256
    assert block_rows(10**6, ROW_BLOCK_BYTES) == MIN_BLOCK_ROWS and block_rows(1536, 0) == 0
