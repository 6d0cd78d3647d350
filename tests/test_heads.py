"""Heads: pooling over packed output, and per-item truncation, normalisation and output dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.heads import finish, pool
from shoal.layers import AttentionMeta

LENGTHS = [1, 9, 4, 17, 2, 30]
HIDDEN = 24


@pytest.fixture(scope="module")
def packed():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(sum(LENGTHS), HIDDEN, generator=g)  # [T, hidden]
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    meta = AttentionMeta.build(cu, max(LENGTHS))
    sequences = list(torch.split(hidden, LENGTHS))  # the per-sequence view, [len, hidden] each
    return hidden, meta, sequences


@pytest.mark.parametrize(
    "method, reference",
    [
        ("cls", lambda seq: seq[0]),
        ("mean", lambda seq: seq.mean(0)),
        ("last", lambda seq: seq[-1]),
    ],
)
def test_pooling_over_packed_output_matches_pooling_each_sequence_alone(packed, method, reference):
    hidden, meta, sequences = packed
    pooled = pool(hidden, meta, method)
    expected = torch.stack([reference(seq) for seq in sequences])
    assert pooled.shape == (len(LENGTHS), HIDDEN)
    torch.testing.assert_close(pooled, expected, rtol=1e-6, atol=1e-6)


def test_mean_pooling_does_not_leak_tokens_across_sequence_boundaries(packed):
    hidden, meta, sequences = packed
    changed = hidden.clone()
    changed[: LENGTHS[0] + LENGTHS[1]] += 100.0  # perturb only the first two sequences
    before, after = pool(hidden, meta, "mean"), pool(changed, meta, "mean")
    torch.testing.assert_close(after[2:], before[2:])
    assert (after[:2] - before[:2]).abs().min().item() > 50.0


def test_unknown_pooling_is_refused(packed):
    hidden, meta, _ = packed
    with pytest.raises(ValueError, match="max"):
        pool(hidden, meta, "max")


@pytest.fixture(scope="module")
def vector() -> np.ndarray:
    return np.random.default_rng(1).standard_normal(64).astype(np.float32) * 3.0


def test_finish_float32_normalised_is_the_unit_vector(vector):
    out = finish(vector, dimensions=None, normalize=True, output_dtype="float32")
    assert out.dtype == np.float32 and out.shape == (64,)
    np.testing.assert_allclose(out, vector / np.linalg.norm(vector), rtol=1e-6)


def test_finish_without_normalisation_keeps_the_raw_vector(vector):
    out = finish(vector, dimensions=None, normalize=False, output_dtype="float32")
    np.testing.assert_array_equal(out, vector)


def test_matryoshka_truncation_happens_before_normalisation(vector):
    out = finish(vector, dimensions=16, normalize=True, output_dtype="float32")
    assert out.shape == (16,)
    assert abs(float(np.linalg.norm(out)) - 1.0) < 1e-6  # unit norm at the truncated size
    np.testing.assert_allclose(out, vector[:16] / np.linalg.norm(vector[:16]), rtol=1e-6)
    # Normalising first and truncating after would give a shorter-than-unit vector instead.
    assert float(np.linalg.norm((vector / np.linalg.norm(vector))[:16])) < 0.9


def test_truncation_without_normalisation_keeps_the_leading_components(vector):
    out = finish(vector, dimensions=10, normalize=False, output_dtype="float32")
    np.testing.assert_array_equal(out, vector[:10])


def test_float16_output_is_the_float32_result_cast(vector):
    out = finish(vector, dimensions=32, normalize=True, output_dtype="float16")
    reference = vector[:32] / np.linalg.norm(vector[:32])
    assert out.dtype == np.float16 and out.shape == (32,)
    np.testing.assert_array_equal(out, reference.astype(np.float16))


def test_int8_output_keeps_cosine_and_uses_the_full_range(vector):
    out = finish(vector, dimensions=None, normalize=True, output_dtype="int8")
    assert out.dtype == np.int8 and out.shape == (64,)
    assert int(np.abs(out.astype(np.int32)).max()) == 127
    as_float = out.astype(np.float64)
    cosine = as_float @ vector / (np.linalg.norm(as_float) * np.linalg.norm(vector))
    assert cosine >= 0.999
    assert (np.sign(out[np.abs(vector) > 0.1]) == np.sign(vector[np.abs(vector) > 0.1])).all()


def test_int8_output_of_a_zero_vector_is_zero():
    out = finish(np.zeros(8, dtype=np.float32), dimensions=None, normalize=True, output_dtype="int8")
    np.testing.assert_array_equal(out, np.zeros(8, dtype=np.int8))


@pytest.mark.parametrize("dimensions", [None, 16, 13])
def test_binary_outputs_pack_the_sign_bits_like_numpy_packbits(vector, dimensions):
    out = finish(vector, dimensions=dimensions, normalize=True, output_dtype="ubinary")
    size = dimensions or vector.shape[0]
    assert out.dtype == np.uint8 and out.shape == ((size + 7) // 8,)
    np.testing.assert_array_equal(out, np.packbits(vector[:size] > 0))
    np.testing.assert_array_equal(np.unpackbits(out)[:size].astype(bool), vector[:size] > 0)
    signed = finish(vector, dimensions=dimensions, normalize=True, output_dtype="binary")
    assert signed.dtype == np.int8
    np.testing.assert_array_equal(signed.astype(np.int16) + 128, out)


def test_unknown_output_dtype_is_refused(vector):
    with pytest.raises(ValueError, match="bfloat8"):
        finish(vector, dimensions=None, normalize=True, output_dtype="bfloat8")
