"""Mean pooling of half-precision hidden states sums in float32: all-MiniLM-L6-v2's real weights in
float16 and bfloat16, on a long text, pooled by shoal against the float32 sum of the very same half
states; a half-precision running sum of them is measurably worse, so the test can fail."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import yaml

from shoal.catalog import Catalog, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.engine.tokenizer import TextTokenizer
from shoal.heads import pool
from shoal.layers import AttentionMeta, PackedInputs
from shoal.weights import build_model

MAX_LENGTH = 512  # MiniLM's position table: the longest sequence, the longest sum
LONG_TEXT = " ".join(f"Sentence {i} tells how the river rose after the rain and the town met." for i in range(60))


@pytest.fixture(scope="module")
def minilm_dir():
    return resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def half_states(request, minilm_dir):
    """(dtype name, the model's half hidden states `[T, 384]` for LONG_TEXT, their meta)."""
    [seq] = TextTokenizer.from_dir(minilm_dir, MAX_LENGTH).encode([LONG_TEXT], truncate=True)
    assert len(seq) == MAX_LENGTH
    model = build_model(minilm_dir, "bert", "cpu", request.param)
    ids = torch.from_numpy(seq.ids)
    meta = AttentionMeta.build(torch.tensor([0, len(seq)], dtype=torch.int32), len(seq))
    with torch.inference_mode():
        states = model(PackedInputs(ids, torch.arange(len(seq)), meta))
    assert states.dtype == getattr(torch, request.param)
    return request.param, states, meta


def test_mean_pooling_of_half_states_equals_their_float32_sum(half_states):
    _, states, meta = half_states
    reference = states.float().sum(0) / states.shape[0]  # the float32 sum of the same half values
    pooled = pool(states, meta, "mean", dtype=torch.float32)[0]
    torch.testing.assert_close(pooled, reference, rtol=1e-6, atol=1e-6)
    # Asked for the states' own dtype, the float32 mean is rounded once, at the end.
    assert pool(states, meta, "mean")[0].dtype == states.dtype
    torch.testing.assert_close(pool(states, meta, "mean")[0], reference.to(states.dtype), rtol=0, atol=0)


def test_a_half_precision_running_sum_would_differ(half_states):
    """What the test above rules out: adding the states in their own dtype one token at a time (as
    a GPU's atomic adds into a half tensor do), or handing back a mean rounded to half precision."""
    _, states, meta = half_states
    reference = states.float().sum(0) / states.shape[0]
    running = states[0].clone()
    for token in states[1:]:
        running += token  # [384], rounded to half after every add
    running_error = ((running / states.shape[0]).float() - reference).abs().max().item()
    rounded_error = (reference.to(states.dtype).float() - reference).abs().max().item()
    ours_error = (pool(states, meta, "mean", dtype=torch.float32)[0] - reference).abs().max().item()
    assert running_error > 1e-3 > 100 * ours_error, (running_error, ours_error)
    assert rounded_error > 100 * ours_error, (rounded_error, ours_error)


def test_a_half_precision_card_serves_the_float32_mean(half_states, minilm_dir, tmp_path):
    """Through the engine (a float16/bfloat16 card, the dense head): the served vector is the
    float32 mean of the model's half states, not a half-precision sum."""
    dtype, states, _ = half_states
    (tmp_path / "card.yaml").write_text(
        yaml.safe_dump(
            {
                "id": "local/minilm-half",
                "architecture": "bert",
                "source": {"path": str(minilm_dir)},
                "max_length": MAX_LENGTH,
                "pooling": "mean",
                "normalize": True,
                "dimensions": 384,
                "dtype": dtype,
            }
        )
    )

    async def main():
        engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(tmp_path,)), allow_download=False)
        await engine.start()
        try:
            return await engine.encode(EncodeCall("local/minilm-half", [LONG_TEXT]))
        finally:
            await engine.stop()

    [vector] = asyncio.run(main()).vectors
    # The folder's Normalize module ends the pipeline (all-MiniLM-L6-v2's modules.json).
    reference = torch.nn.functional.normalize(states.float().sum(0) / states.shape[0], dim=0).numpy()
    np.testing.assert_allclose(vector, reference, rtol=1e-6, atol=1e-6)
