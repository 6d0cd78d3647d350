"""The OpenSearch neural sparse cards against their reference: the model cards' own code (masked-LM
logits from transformers, max over the text, log(1 + relu), every special token's entry zeroed), run
here on random BERT and DistilBERT masked-LM checkpoints with MiniLM's vocabulary. sentence-transformers'
SparseEncoder does not model the zeroing (its SpladePooling keeps special tokens), so it is not the
reference for these checkpoints."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml

from shoal.catalog import Catalog, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine

TEXTS = [
    "What's the weather in ny now?",
    "Currently New York is rainy.",
    "a [MASK] and an [UNK] typed as text",
    "Shoals of small fish move together; predators find it hard to pick one out.",
]

CHECKPOINTS = {
    "opensearch-project/opensearch-neural-sparse-encoding-v1": lambda: transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=30522,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=128,
        )
    ),
    "opensearch-project/opensearch-neural-sparse-encoding-v2-distill": lambda: transformers.DistilBertForMaskedLM(
        transformers.DistilBertConfig(
            vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128
        )
    ),
}


def save_checkpoint(directory: Path, model_id: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = CHECKPOINTS[model_id]().eval()
    with torch.no_grad():  # a non-zero output bias, so logits differ from a plain tied projection
        model.get_output_embeddings().bias.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    minilm = resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, directory / name)
    return model


def model_card_reference(model, tokenizer, texts: list[str], zero_special: bool = True) -> np.ndarray:
    """`[n, V]`: the OpenSearch model cards' `get_sparse_vector`, with their special-token list."""
    feature = tokenizer(texts, padding=True, truncation=True, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        output = model(**feature)[0]
    values, _ = torch.max(output * feature["attention_mask"].unsqueeze(-1), dim=1)
    values = torch.log(1 + torch.relu(values))
    if zero_special:
        special_token_ids = [tokenizer.vocab[token] for token in tokenizer.special_tokens_map.values()]
        values[:, special_token_ids] = 0
    return values.numpy()


@pytest.mark.parametrize("model_id", CHECKPOINTS, ids=["v1-bert", "v2-distill-distilbert"])
def test_opensearch_sparse_weights_equal_the_model_cards_reference_with_special_tokens_zeroed(tmp_path, model_id):
    weights, cards = tmp_path / "weights", tmp_path / "cards"
    weights.mkdir(), cards.mkdir()
    model = save_checkpoint(weights, model_id)
    card = yaml.safe_load(Path(Catalog.load().get(model_id).card_path).read_text())
    card.update(id="test/opensearch", source={"path": str(weights)}, max_length=128, dimensions=32)
    (cards / "card.yaml").write_text(yaml.safe_dump(card))
    engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(cards,)), allow_download=False)

    async def go():
        await engine.start()
        try:
            return await engine.encode(EncodeCall("test/opensearch", TEXTS, outputs=("sparse",)))
        finally:
            await engine.stop()

    items = asyncio.run(go()).items
    tokenizer = transformers.AutoTokenizer.from_pretrained(weights)
    expected = model_card_reference(model, tokenizer, TEXTS)
    special = sorted(tokenizer.vocab[t] for t in tokenizer.special_tokens_map.values())
    for item, ref in zip(items, expected):
        got = np.zeros_like(ref)
        got[item.sparse.indices] = item.sparse.values
        assert np.abs(got - ref).max() <= 1e-4
        assert not set(item.sparse.indices.tolist()) & set(special)
    # Without the zeroing the special entries carry weight, so the card's setting is what decides.
    assert (model_card_reference(model, tokenizer, TEXTS, zero_special=False)[:, special].max(axis=1) > 0).all()
