"""Retrieval quality equals the reference's: Spearman correlation with human judgements on the Lee
document-similarity set (50 news documents, 1,225 scored pairs, shipped in the gensim wheel)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr
from sentence_transformers import SentenceTransformer

from shoal.catalog import Catalog, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.errors import ModelLoadError


def lee_data() -> tuple[list[str], np.ndarray]:
    spec = importlib.util.find_spec("gensim")  # data files only: gensim itself is not imported
    data = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"
    docs = [line.decode("latin-1").strip() for line in (data / "lee.cor").read_bytes().splitlines() if line.strip()]
    human = np.loadtxt(data / "similarities0-1.txt")
    assert len(docs) == 50 and human.shape == (50, 50)
    return docs, human[np.triu_indices(50, 1)]  # 1,225 pairs


def spearman(vectors: np.ndarray, human: np.ndarray) -> float:
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = unit @ unit.T
    return float(spearmanr(cosine[np.triu_indices(len(vectors), 1)], human).correlation)


@pytest.mark.parametrize(
    "model_id", ["sentence-transformers/all-MiniLM-L6-v2", "sentence-transformers/all-mpnet-base-v2"]
)
def test_lee_spearman_equals_sentence_transformers(model_id):
    catalog = Catalog.load()
    try:
        directory = resolve_weights(catalog.get(model_id), allow_download=False)
    except ModelLoadError as exc:
        pytest.skip(f"weights not installed here: {exc}")
    docs, human = lee_data()

    async def shoal_vectors():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            return np.stack((await engine.encode(EncodeCall(model_id, docs))).vectors)
        finally:
            await engine.stop()

    ours = spearman(asyncio.run(shoal_vectors()), human)
    reference = spearman(SentenceTransformer(str(directory), device="cpu").encode(docs), human)
    assert reference > 0.3, f"the reference itself is implausible on Lee: {reference}"
    assert abs(ours - reference) <= 1e-3, f"shoal {ours:.5f} vs sentence-transformers {reference:.5f}"
