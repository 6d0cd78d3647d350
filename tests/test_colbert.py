"""ColBERT multi-vector outputs against the reference, run here on a random BERT saved in colbert-ir's
(Stanford) layout with its `artifact.metadata`: markers, [MASK] query expansion that is not attended to,
the document length, punctuation skipping; and MaxSim against `pylate.scores.colbert_scores`.

The reference model is sentence-transformers' `MultiVectorEncoder`, PyLate's ColBERT as merged into
sentence-transformers (it reads Stanford checkpoints and their metadata as PyLate does).
`pylate.models.ColBERT` 1.6.0 cannot run here: it pins sentence-transformers 5.3.0, and under the
installed 6.2 its `encode` fails (`_text_length` is gone) and its tokenizer call no longer pads queries
to `query_length` (sentence-transformers 6 drops the `padding` argument), so it would expand nothing.
`pylate.scores` is plain torch and is used as is.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file

from shoal.catalog import Catalog, parse_card, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine, ScoreCall
from shoal.engine.runner import ModelRunner
from shoal.engine.types import Batch, EncodeSpec
from shoal.vectors import maxsim

pylate_scores = pytest.importorskip("pylate.scores")
MultiVectorEncoder = pytest.importorskip("sentence_transformers").MultiVectorEncoder

DIM = 16
QUERY_LENGTH = 12
DOCUMENT_LENGTH = 24

QUERIES = ["what is a shoal?", "fish", "why do small fish swim together in large groups near the surface at dawn"]
DOCUMENTS = [
    "Shoals, schools and swarms: fish move together!",
    "no punctuation here",
    (
        "Shoals of small fish move together; predators find it hard to pick one out. Sardines, herring and anchovies "
        "form the largest shoals in the open ocean, sometimes kilometres long."
    ),
]


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory):
    """A random BERT with MiniLM's vocabulary, saved as colbert-ir ships ColBERTv2: `bert.`-prefixed
    encoder tensors and the `linear.weight` projection in one safetensors, architecture HF_ColBERT,
    and the lengths and markers in `artifact.metadata`."""
    directory = tmp_path_factory.mktemp("tiny-colbert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    transformers.BertModel(config, add_pooling_layer=False).eval().save_pretrained(directory)
    tensors = {f"bert.{name}": t for name, t in load_file(directory / "model.safetensors").items()}
    tensors["linear.weight"] = torch.randn(DIM, 64) * 0.2
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "architectures": ["HF_ColBERT"]}))
    (directory / "artifact.metadata").write_text(
        json.dumps(
            {
                "query_token_id": "[unused0]",
                "doc_token_id": "[unused1]",
                "query_maxlen": QUERY_LENGTH,
                "doc_maxlen": DOCUMENT_LENGTH,
                "attend_to_mask_tokens": False,
                "mask_punctuation": True,
            }
        )
    )
    minilm = resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, directory / name)
    return directory


def card_yaml(directory, attend: bool) -> str:
    return f"""
id: test/colbert
architecture: bert
source: {{path: {directory}}}
max_length: 64
outputs: [multivector]
multivector:
  dim: {DIM}
  query_marker: "[unused0]"
  document_marker: "[unused1]"
  query_length: {QUERY_LENGTH}
  document_length: {DOCUMENT_LENGTH}
  attend_to_expansion_tokens: {str(attend).lower()}
  skip_punctuation: true
"""


def shoal_vectors(tmp_path, directory, texts: list[str], is_query: bool, attend: bool = False) -> list[np.ndarray]:
    (tmp_path / "card.yaml").write_text(card_yaml(directory, attend))
    engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(tmp_path,)), allow_download=False)

    async def go():
        await engine.start()
        try:
            return await engine.encode(EncodeCall("test/colbert", texts, outputs=("multivector",), is_query=is_query))
        finally:
            await engine.stop()

    return [item.multivector for item in asyncio.run(go()).items]


def reference_model(directory, attend: bool):
    model = MultiVectorEncoder(str(directory), device="cpu")
    expansion = model[0].query_expansion
    # What it read from artifact.metadata, as PyLate reads it.
    assert expansion["length"] == QUERY_LENGTH and expansion["attend"] is False
    assert model[0].document_length == DOCUMENT_LENGTH
    if attend:  # a checkpoint with attend_to_mask_tokens: true
        model[0].query_expansion = {**expansion, "attend": True}
    return model


def reference_vectors(model, texts: list[str], is_query: bool) -> list[np.ndarray]:
    encode = model.encode_query if is_query else model.encode_document
    return [np.asarray(v, dtype=np.float32) for v in encode(texts, convert_to_numpy=True)]


@pytest.fixture(scope="module")
def reference(colbert_dir):
    model = reference_model(colbert_dir, attend=False)
    tokens = [model.preprocess(["[unused1] " + d], task="document")["input_ids"].shape[1] for d in DOCUMENTS]
    return {
        "queries": reference_vectors(model, QUERIES, is_query=True),
        "documents": reference_vectors(model, DOCUMENTS, is_query=False),
        "document_tokens": tokens,
    }


def assert_same_vectors(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        assert np.abs(g - e).max() <= 1e-5


def test_colbert_queries_equal_the_reference_with_unattended_mask_expansion(tmp_path, colbert_dir, reference):
    got = shoal_vectors(tmp_path, colbert_dir, QUERIES, is_query=True)
    assert all(v.shape == (QUERY_LENGTH, DIM) for v in got)  # expanded (or cut) to the query length
    assert_same_vectors(got, reference["queries"])


def test_colbert_queries_equal_the_reference_when_the_card_attends_to_the_expansion(tmp_path, colbert_dir, reference):
    attending = reference_vectors(reference_model(colbert_dir, attend=True), QUERIES, is_query=True)
    got = shoal_vectors(tmp_path, colbert_dir, QUERIES, is_query=True, attend=True)
    assert_same_vectors(got, attending)
    # The two settings really differ on queries that are expanded, so each test above could fail.
    assert np.abs(attending[0] - reference["queries"][0]).max() > 1e-3


def test_colbert_documents_equal_the_reference_cut_to_the_document_length_without_punctuation(
    tmp_path, colbert_dir, reference
):
    got = shoal_vectors(tmp_path, colbert_dir, DOCUMENTS, is_query=False)
    assert_same_vectors(got, reference["documents"])
    tokens = reference["document_tokens"]
    assert tokens[2] == DOCUMENT_LENGTH  # the long document is cut at the document length, not max_length
    assert len(got[0]) < tokens[0] and len(got[1]) == tokens[1]  # only punctuation tokens are dropped


def test_queries_and_documents_packed_in_one_batch_equal_the_reference(colbert_dir, reference):
    # As the score task packs them: only the queries' sequences have keys short of their length.
    card = parse_card(yaml.safe_load(card_yaml(colbert_dir, attend=False)), "inline.yaml")
    runner = ModelRunner.from_dir(card, colbert_dir, "cpu")
    seqs = runner.query_tokenizer.encode(QUERIES, truncate=True) + runner.document_tokenizer.encode(DOCUMENTS, True)
    batch = Batch.pack(seqs[::-1])  # documents first, then the queries
    assert batch.key_lengths is not None and (batch.key_lengths < np.diff(batch.cu_seqlens)).any()
    specs = [
        EncodeSpec(
            normalize=True,
            dimensions=None,
            output_dtype="float32",
            outputs=("multivector",),
            is_query=i >= len(DOCUMENTS),
        )
        for i in range(len(seqs))
    ]
    got = [item.multivector for item in runner.forward(batch, specs)][::-1]
    assert_same_vectors(got, reference["queries"] + reference["documents"])


def test_maxsim_equals_pylate_colbert_scores_on_vectors_shoal_produced(tmp_path, colbert_dir):
    queries = shoal_vectors(tmp_path, colbert_dir, QUERIES, is_query=True)
    documents = shoal_vectors(tmp_path, colbert_dir, DOCUMENTS, is_query=False)
    for q in queries:
        for d in documents:
            expected = pylate_scores.colbert_scores(
                torch.from_numpy(q)[None], torch.from_numpy(d)[None], backend="torch"
            )
            assert abs(maxsim(q, d) - float(expected[0, 0])) <= 1e-5
    # Not symmetric and not a mean: swapping the arguments changes the value.
    assert abs(maxsim(queries[0], documents[0]) - maxsim(documents[0], queries[0])) > 1e-3


def test_maxsim_of_an_empty_document_is_zero_as_pylate_masks_it():
    q = np.ones((3, 4), dtype=np.float32)
    expected = pylate_scores.colbert_scores(
        torch.from_numpy(q)[None], torch.zeros(1, 2, 4), documents_mask=torch.zeros(1, 2), backend="torch"
    )
    assert maxsim(q, np.zeros((0, 4), dtype=np.float32)) == float(expected[0, 0]) == 0.0


def test_score_on_a_colbert_card_ranks_by_maxsim_of_the_reference_vectors(tmp_path, colbert_dir, reference):
    """One verb for late interaction too: `score` tokenizes the query as a query and the documents
    as documents, and its scores are pylate's MaxSim of the reference model's vectors."""
    (tmp_path / "card.yaml").write_text(card_yaml(colbert_dir, attend=False))
    engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(tmp_path,)), allow_download=False)

    async def go():
        await engine.start()
        try:
            return await engine.score(ScoreCall("test/colbert", QUERIES[0], DOCUMENTS))
        finally:
            await engine.stop()

    result = asyncio.run(go())
    q = torch.from_numpy(reference["queries"][0])[None]
    expected = [
        float(pylate_scores.colbert_scores(q, torch.from_numpy(d)[None], backend="torch")[0, 0])
        for d in reference["documents"]
    ]
    got = {item.index: item.score for item in result.items}
    assert max(abs(got[i] - expected[i]) for i in range(len(DOCUMENTS))) <= 1e-4
    assert [item.index for item in result.items] == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
