"""shoal's packed DistilBERT against transformers.DistilBertModel, and its SPLADE output against
DistilBertForMaskedLM, on random-initialised checkpoints."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import torch
import transformers

from parity import (
    assert_packing_invariant,
    max_abs_diff,
    packed_batch,
    packed_hidden_states,
    randomize_norms,
    reference_hidden_states,
)
from shoal.catalog import Catalog, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.weights import build_model

MAX_LENGTH = 128
SHAPES = {
    "tiny-2l-2h": dict(n_layers=2, n_heads=2, dim=32, hidden_dim=64),
    "mini-3l-8h-gelu-tanh": dict(n_layers=3, n_heads=8, dim=256, hidden_dim=320, activation="gelu_new"),
    "sinusoidal-2l-4h": dict(n_layers=2, n_heads=4, dim=64, hidden_dim=128, sinusoidal_pos_embds=True),
}


def save_random(directory, masked_lm: bool = False, vocab_size: int = 1000, **shape):
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(vocab_size=vocab_size, max_position_embeddings=MAX_LENGTH, **shape)
    model_class = transformers.DistilBertForMaskedLM if masked_lm else transformers.DistilBertModel
    reference = model_class(config).eval()
    randomize_norms(reference, 0.1)
    reference.save_pretrained(directory)
    return reference


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_distilbert_matches_transformers_on_mixed_lengths(tmp_path, shape):
    reference = save_random(tmp_path, **SHAPES[shape])
    ours = build_model(tmp_path, None, "cpu")
    batch = packed_batch([1, MAX_LENGTH, 7, 2, 63, MAX_LENGTH, 30, 5], 1000)
    diff = max_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference, batch))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def test_a_distilbert_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random(tmp_path, **SHAPES["tiny-2l-2h"])
    assert_packing_invariant(
        build_model(tmp_path, None, "cpu"), packed_batch([40, 3, MAX_LENGTH, 17, 1], 1000), atol=1e-5
    )


def test_distilbert_splade_weights_equal_the_masked_lm_reference(tmp_path):
    """A DistilBertForMaskedLM checkpoint (tied projector) served as a SPLADE card: max over tokens of
    log(1 + relu(logits)) equals transformers' on the same token ids."""
    minilm = resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)
    model_dir = tmp_path / "model"
    reference = save_random(model_dir, masked_lm=True, vocab_size=30522, **SHAPES["tiny-2l-2h"])
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, model_dir / name)
    (tmp_path / "cards").mkdir()
    (tmp_path / "cards" / "card.yaml").write_text(
        f"id: test/distil-splade\narchitecture: distilbert\nsource: {{path: {model_dir}}}\nmax_length: {MAX_LENGTH}\n"
        "pooling: cls\nnormalize: false\ndimensions: 32\noutputs: [sparse]\n"
    )
    texts = ["sparse retrieval with distilled encoders", "a"]

    async def encode():
        engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(tmp_path / "cards",)), allow_download=False)
        await engine.start()
        try:
            return await engine.encode(EncodeCall("test/distil-splade", texts))
        finally:
            await engine.stop()

    result = asyncio.run(encode())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text, item in zip(texts, result.items):
        with torch.no_grad():
            logits = reference(**tokenizer([text], return_tensors="pt")).logits[0]  # [L, V]
        expected = torch.log1p(torch.relu(logits)).max(dim=0).values.numpy()
        got = np.zeros_like(expected)
        got[item.sparse.indices] = item.sparse.values
        assert np.abs(got - expected).max() <= 1e-4
        assert len(item.sparse.indices) > 0
