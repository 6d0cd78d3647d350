"""Sparse (SPLADE, BGE-M3 token weights) and multi-vector (ColBERT) outputs against references
computed here with `transformers`."""

from __future__ import annotations

import asyncio
import shutil
import string

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

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
    result = run(Engine(EngineSettings(), Catalog.load(), allow_download=False),
                 EncodeCall("rasyosef/splade-tiny", TEXTS, outputs=("sparse",)))
    for item, ref in zip(result.items, expected):
        got = np.zeros_like(ref)
        got[item.sparse.indices] = item.sparse.values
        assert np.abs(got - ref).max() <= 1e-4
        assert set(np.flatnonzero(ref > 1e-4)) <= set(item.sparse.indices.tolist())  # no real term lost
        assert np.all(np.diff(item.sparse.values) <= 0), "entries come heaviest first"


def test_splade_top_k_keeps_the_heaviest_terms_and_names_their_tokens(splade_reference):
    expected, tokenizer = splade_reference
    result = run(Engine(EngineSettings(), Catalog.load(), allow_download=False),
                 EncodeCall("rasyosef/splade-tiny", TEXTS, sparse_top_k=5, return_tokens=True))
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


# --- ColBERT and BGE-M3 on random weights -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A random BERT with MiniLM's vocabulary and tokenizer, plus ColBERT/BGE-M3 head tensors."""
    directory = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=512)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(directory)
    minilm = resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, directory / name)
    # ColBERT (colbert-ir layout): the projection sits in the model's own safetensors.
    tensors = load_file(directory / "model.safetensors")
    projection = torch.randn(16, 64) * 0.2
    tensors["linear.weight"] = projection
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    # BGE-M3 layout: heads in separate torch files.
    sparse_linear = torch.nn.Linear(64, 1)
    colbert_linear = torch.nn.Linear(64, 24)
    torch.save(sparse_linear.state_dict(), directory / "sparse_linear.pt")
    torch.save(colbert_linear.state_dict(), directory / "colbert_linear.pt")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return dict(dir=directory, model=model, tokenizer=tokenizer, projection=projection,
                sparse_linear=sparse_linear, colbert_linear=colbert_linear)


def hidden_states(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [L, h]


COLBERT_CARD = """
id: test/colbert
architecture: bert
source: {{path: {dir}}}
max_length: 64
pooling: cls
dimensions: 64
outputs: [multivector]
multivector:
  dim: 16
  query_marker: "[unused0]"
  document_marker: "[unused1]"
  query_length: 12
  skip_punctuation: true
"""


def test_colbert_queries_are_marked_and_mask_augmented_like_the_reference(tmp_path, tiny_bert):
    catalog = catalog_with(tmp_path, COLBERT_CARD.format(dir=tiny_bert["dir"]))
    queries = ["what is a shoal?", "fish"]
    result = run(Engine(EngineSettings(), catalog, allow_download=False),
                 EncodeCall("test/colbert", queries, outputs=("multivector",), is_query=True))
    tok = tiny_bert["tokenizer"]
    for query, item in zip(queries, result.items):
        ids = tok(query)["input_ids"]
        ids = ids[:1] + tok.convert_tokens_to_ids(["[unused0]"]) + ids[1:]
        ids += [tok.mask_token_id] * (12 - len(ids))
        expected = torch.nn.functional.normalize(hidden_states(tiny_bert["model"], ids) @ tiny_bert["projection"].T, dim=-1)
        assert item.multivector.shape == (12, 16)
        assert np.abs(item.multivector - expected.numpy()).max() <= 1e-5


def test_colbert_documents_are_marked_and_drop_punctuation_tokens(tmp_path, tiny_bert):
    catalog = catalog_with(tmp_path, COLBERT_CARD.format(dir=tiny_bert["dir"]))
    docs = ["Shoals, schools and swarms: fish move together!", "no punctuation here"]
    result = run(Engine(EngineSettings(), catalog, allow_download=False),
                 EncodeCall("test/colbert", docs, outputs=("multivector",), is_query=False))
    tok = tiny_bert["tokenizer"]
    punctuation = set(tok.convert_tokens_to_ids(list(string.punctuation)))
    for doc, item in zip(docs, result.items):
        ids = tok(doc)["input_ids"]
        ids = ids[:1] + tok.convert_tokens_to_ids(["[unused1]"]) + ids[1:]
        full = torch.nn.functional.normalize(hidden_states(tiny_bert["model"], ids) @ tiny_bert["projection"].T, dim=-1)
        keep = [i for i, t in enumerate(ids) if t not in punctuation]
        assert item.multivector.shape == (len(keep), 16)
        assert np.abs(item.multivector - full[keep].numpy()).max() <= 1e-5
    assert len(result.items[0].multivector) < len(tok(docs[0])["input_ids"]) + 1  # punctuation was dropped


BGE_M3_CARD = """
id: test/bge-m3-like
architecture: bert
source: {{path: {dir}}}
max_length: 64
pooling: cls
dimensions: 64
outputs: [dense, sparse, multivector]
sparse: {{kind: token_weights, file: sparse_linear.pt, weight: weight, bias: bias}}
multivector: {{dim: 24, file: colbert_linear.pt, weight: weight, bias: bias, skip_first: true}}
"""


def test_dense_sparse_and_multivector_come_from_one_pass_as_bge_m3_defines_them(tmp_path, tiny_bert):
    catalog = catalog_with(tmp_path, BGE_M3_CARD.format(dir=tiny_bert["dir"]))
    texts = ["the the cat", "Late interaction keeps one vector per token."]
    result = run(Engine(EngineSettings(), catalog, allow_download=False),
                 EncodeCall("test/bge-m3-like", texts, outputs=("dense", "sparse", "multivector")))
    tok = tiny_bert["tokenizer"]
    special = set(tok.all_special_ids)
    for text, item in zip(texts, result.items):
        ids = tok(text)["input_ids"]
        h = hidden_states(tiny_bert["model"], ids)
        dense = torch.nn.functional.normalize(h[0], dim=-1)
        assert np.abs(item.dense - dense.numpy()).max() <= 1e-5
        with torch.no_grad():
            weights = torch.relu(tiny_bert["sparse_linear"](h)).squeeze(-1)
            colbert = torch.nn.functional.normalize(tiny_bert["colbert_linear"](h[1:]), dim=-1)
        expected_sparse: dict[int, float] = {}
        for token_id, w in zip(ids, weights.tolist()):
            if token_id not in special and w > 0:
                expected_sparse[token_id] = max(w, expected_sparse.get(token_id, 0.0))
        got_sparse = dict(zip(item.sparse.indices.tolist(), item.sparse.values.tolist()))
        assert got_sparse.keys() == expected_sparse.keys()
        assert max(abs(got_sparse[k] - v) for k, v in expected_sparse.items()) <= 1e-5
        assert np.abs(item.multivector - colbert.numpy()).max() <= 1e-5


def test_a_card_with_multivector_output_but_no_multivector_block_is_refused(tmp_path):
    from shoal.errors import CardError

    with pytest.raises(CardError, match="multivector"):
        parse_card({"id": "x", "source": {"hub": "x/y"}, "max_length": 8, "pooling": "cls", "dimensions": 8,
                    "outputs": ["multivector"]}, "inline.yaml")
