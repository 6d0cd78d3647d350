"""SPLADE sparse outputs against `transformers`' masked-LM head, run here on real weights, and what
the engine refuses. ColBERT is tested against its reference in test_colbert.py, BGE-M3 against
FlagEmbedding in test_bge_m3.py, the OpenSearch sparse cards in test_opensearch_sparse.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import transformers

from shoal.catalog import Catalog, parse_card, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.errors import InvalidRequest

TEXTS = [
    "The cat sat on the mat.",
    "Quantum computing uses qubits, superposition and entanglement!",
    "a",
    "Shoals of small fish move together; predators find it hard to pick one out.",
    "Stock markets fell sharply on Tuesday after the central bank raised interest rates by half a point.",
]


def run(engine: Engine, call: EncodeCall):
    async def go():
        await engine.start()
        try:
            return await engine.encode(call)
        finally:
            await engine.stop()

    return asyncio.run(go())


def catalog_with(tmp_path, card_yaml: str) -> Catalog:
    (tmp_path / "card.yaml").write_text(card_yaml)
    return Catalog.load(extra_dirs=(tmp_path,))


# --- SPLADE on real weights ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def splade_dir():
    return resolve_weights(Catalog.load().get("rasyosef/splade-tiny"), allow_download=False)


@pytest.fixture(scope="module")
def splade_reference(splade_dir):
    """Term weights per text from transformers' BertForMaskedLM: max_t log(1 + relu(logits))."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(splade_dir)
    model = transformers.AutoModelForMaskedLM.from_pretrained(splade_dir).eval()
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    weights = torch.log1p(torch.relu(logits)) * batch["attention_mask"][..., None]
    return weights.max(dim=1).values.numpy(), tokenizer


def test_splade_weights_equal_transformers_masked_lm_on_real_weights(splade_reference):
    expected, _ = splade_reference
    result = run(
        Engine(EngineSettings(), Catalog.load(), allow_download=False),
        EncodeCall("rasyosef/splade-tiny", TEXTS, outputs=("sparse",)),
    )
    for item, ref in zip(result.items, expected):
        got = np.zeros_like(ref)
        got[item.sparse.indices] = item.sparse.values
        assert np.abs(got - ref).max() <= 1e-4
        assert set(np.flatnonzero(ref > 1e-4)) <= set(item.sparse.indices.tolist())  # no real term lost
        assert np.all(np.diff(item.sparse.values) <= 0), "entries come heaviest first"


def test_splade_top_k_keeps_the_heaviest_terms_and_names_their_tokens(splade_reference):
    expected, tokenizer = splade_reference
    result = run(
        Engine(EngineSettings(), Catalog.load(), allow_download=False),
        EncodeCall("rasyosef/splade-tiny", TEXTS, sparse_top_k=5, return_tokens=True),
    )
    for item, ref in zip(result.items, expected):
        top = np.argsort(-ref)[:5]
        assert item.sparse.indices.tolist() == top.tolist()
        assert item.sparse.tokens == tokenizer.convert_ids_to_tokens(top.tolist())


def test_sparse_from_a_dense_only_model_is_refused_naming_model_option_and_allowed():
    engine = Engine(EngineSettings(), Catalog.load(), allow_download=False)
    with pytest.raises(InvalidRequest) as info:
        run(engine, EncodeCall("sentence-transformers/all-MiniLM-L6-v2", ["x"], outputs=("sparse",)))
    message = str(info.value)
    assert "sentence-transformers/all-MiniLM-L6-v2" in message and "sparse" in message and "dense" in message
    assert info.value.details["option"] == "outputs"


# --- cards -------------------------------------------------------------------------------------


def test_a_card_with_multivector_output_but_no_multivector_block_is_refused(tmp_path):
    from shoal.errors import CardError

    with pytest.raises(CardError, match="multivector"):
        parse_card(
            {
                "id": "x",
                "source": {"hub": "x/y"},
                "max_length": 8,
                "pooling": "cls",
                "dimensions": 8,
                "outputs": ["multivector"],
            },
            "inline.yaml",
        )
