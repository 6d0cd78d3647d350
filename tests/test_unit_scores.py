"""Score scales (issue 34): a cosine, a SPLADE dot product and a cross-encoder's logit or
probability are not on one scale, so `unit_scores` maps each kind into 0..1 by a fixed increasing
function (engine/tasks/score.py `unit_scores`), keeping the ranking. Checked over real HTTP against
the references: sentence-transformers' vectors (cosine), its CrossEncoder (sigmoid of the logit),
and transformers' SPLADE head (the dot product); and through the real `cohere` client."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder

from conftest import MODEL_ID
from rerankers import build_minilm_reranker, reranker_card

RERANKER = "test/unit-reranker"
SPLADE = "rasyosef/splade-tiny"
QUERY = "how do shoals of fish avoid predators?"
DOCUMENTS = [
    "The stock market fell sharply on Tuesday.",
    "Fish in a shoal move together, so a predator finds it hard to pick one out.",
    "A recipe for lemon cake with three eggs.",
]


@pytest.fixture(scope="module")
def scored(serve, tmp_path_factory):
    directory = build_minilm_reranker(tmp_path_factory.mktemp("unit-reranker"))
    cards = tmp_path_factory.mktemp("unit-cards")
    (cards / "reranker.yaml").write_text(reranker_card(RERANKER, directory, 256))
    url = serve(preload=(MODEL_ID, RERANKER, SPLADE), cards_dirs=(cards,))
    return url, CrossEncoder(str(directory), max_length=256, device="cpu")


def score(url: str, model: str, **options) -> list[float]:
    body = {"model": model, "query": QUERY, "items": [{"text": d} for d in DOCUMENTS], "options": options}
    answer = httpx.post(f"{url}/v1/score", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return [s for _, s in sorted((item["index"], item["score"]) for item in answer.json()["items"])]


def test_a_cosine_becomes_half_of_one_plus_it(scored, embed_reference):
    url, _ = scored
    vectors = embed_reference([QUERY, *DOCUMENTS])
    cosines = vectors[1:] @ vectors[0]
    assert np.allclose(score(url, MODEL_ID, unit_scores=True), (cosines + 1) / 2, atol=1e-5)


def test_a_cross_encoders_logit_becomes_its_sigmoid_and_a_probability_stays(scored):
    url, reference = scored
    logits = reference.predict([(QUERY, d) for d in DOCUMENTS], activation_fn=torch.nn.Identity())
    sigmoid = 1 / (1 + np.exp(-np.asarray(logits, dtype=np.float64)))
    assert np.allclose(score(url, RERANKER, raw_scores=True, unit_scores=True), sigmoid, atol=1e-5)
    assert np.allclose(score(url, RERANKER, unit_scores=True), sigmoid, atol=1e-5)
    assert np.allclose(score(url, RERANKER), sigmoid, atol=1e-5)  # the card's own activation already is


def test_a_sparse_dot_product_becomes_s_over_one_plus_s_keeping_the_order(scored):
    url, _ = scored
    dots = np.array(score(url, SPLADE))
    assert dots.max() > 1  # not on a 0..1 scale by itself
    unit = np.array(score(url, SPLADE, unit_scores=True))
    assert np.allclose(unit, np.maximum(dots, 0) / (1 + np.maximum(dots, 0)), atol=1e-6)
    assert list(np.argsort(-unit)) == list(np.argsort(-dots)) and ((0 <= unit) & (unit <= 1)).all()


def test_cohere_clients_get_relevance_scores_in_0_1_when_asked(scored, embed_reference):
    cohere = pytest.importorskip("cohere", reason="needs the cohere client")
    url, _ = scored
    co = cohere.ClientV2(base_url=url, api_key="x")
    options = {"additional_body_parameters": {"unit_scores": True}}
    ranked = co.rerank(model=MODEL_ID, query=QUERY, documents=DOCUMENTS, request_options=options)
    vectors = embed_reference([QUERY, *DOCUMENTS])
    expected = (vectors[1:] @ vectors[0] + 1) / 2
    got = sorted((r.index, r.relevance_score) for r in ranked.results)
    assert [i for i, _ in got] == [0, 1, 2] and np.allclose([s for _, s in got], expected, atol=1e-5)
