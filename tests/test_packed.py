"""oneDNN-packed float32 Linears (layers/packed.py): the same outputs as torch's Linear, shards
and hooks kept, the float32 weight dropped and the packed bytes counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shoal.layers import FusedLinear
from shoal.layers.packed import PackedFusedLinear, PackedLinear, available, pack_linears, packed_bytes

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN inner-product ops")


@pytest.mark.parametrize("tokens", [1, 7, 300, 4096, 5000])
def test_a_packed_linear_equals_torchs_linear_for_any_batch(tokens):
    torch.manual_seed(tokens)
    linear = nn.Linear(384, 1536)
    x = torch.randn(tokens, 384)
    expected = linear(x)
    packed = PackedLinear.of(linear)
    got = packed(x)
    assert got.shape == expected.shape
    # float32 accumulation in another order: equal to a float32 rounding of the sums' size.
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4)
    assert torch.allclose(packed(x[:, None, :])[:, 0], expected, rtol=1e-5, atol=1e-4)  # leading dims kept


def test_a_packed_fused_linear_keeps_its_shards_and_a_linear_without_bias_works():
    torch.manual_seed(1)
    fused = FusedLinear(64, (64, 32, 32), bias=False)
    x = torch.randn(10, 64)
    packed = PackedLinear.of(fused)
    assert isinstance(packed, PackedFusedLinear) and packed.bias is None
    for got, want in zip(packed.split(x), fused.split(x)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_float32_linears_only_keeps_forward_hooks_and_counts_bytes():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16).double(), FusedLinear(16, (8, 8)))
    x = torch.randn(5, 32)
    with torch.inference_mode():
        hidden = model[1](model[0](x))
        expected_mid = model[2](hidden.double())
    packed = pack_linears(model)
    assert isinstance(model[0], PackedLinear) and type(model[2]) is nn.Linear  # float64: left alone
    assert isinstance(model[3], PackedFusedLinear)
    assert packed == packed_bytes(model) == (32 * 64 + 16 * 8 * 2) * 4
    assert not any(p.shape == (64, 32) for p in model.parameters())  # the float32 weight is gone
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.inference_mode():
        assert torch.allclose(model[2](model[1](model[0](x)).double()), expected_mid, rtol=1e-5, atol=1e-5)
    assert seen == [torch.Size([5, 64])]
