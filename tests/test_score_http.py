"""Every rerank route over real HTTP on the real engine, with a real-weights cross-encoder (MiniLM
encoder + seeded head): the `cohere` client (v1 and v2), TEI's and Jina's documented shapes with
raw HTTP, and the native /v1/score in JSON and msgpack — each ranked as sentence-transformers'
CrossEncoder ranks the same pairs, computed here."""

from __future__ import annotations

import httpx
import msgspec
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder

from rerankers import build_minilm_reranker, reranker_card

MODEL = "test/minilm-reranker"
QUERY = "how do shoals of fish avoid predators?"
DOCUMENTS = [
    "The stock market fell sharply on Tuesday.",
    "Fish in a shoal move together, so a predator finds it hard to pick one out.",
    "Predators hunt alone at dawn.",
    "A recipe for lemon cake with three eggs.",
    "Schooling confuses predators: many fish turn at once and the shoal splits around the attacker.",
]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    directory = build_minilm_reranker(tmp_path_factory.mktemp("minilm-reranker"))
    cards = tmp_path_factory.mktemp("cards")
    (cards / "reranker.yaml").write_text(reranker_card(MODEL, directory, 256))
    reference = CrossEncoder(str(directory), max_length=256, device="cpu")
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS], activation_fn=torch.nn.Sigmoid())
    return cards, np.asarray(expected)


@pytest.fixture(scope="module")
def url(serve, reranker):
    return serve(preload=(MODEL,), cards_dirs=(reranker[0],))


def ranking(expected: np.ndarray) -> list[int]:
    return list(np.argsort(-expected, kind="stable"))


def test_cohere_v2_client_reranks_as_the_cross_encoder_does(url, reranker):
    import cohere

    expected = reranker[1]
    client = cohere.ClientV2(api_key="unused", base_url=url)
    response = client.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [r.index for r in response.results] == ranking(expected)[:3]
    for r in response.results:
        assert abs(r.relevance_score - expected[r.index]) <= 1e-5
        assert getattr(r, "document", None) is None  # return_documents defaults to false


def test_cohere_v1_client_returns_documents_when_asked(url, reranker):
    import cohere

    expected = reranker[1]
    client = cohere.Client(api_key="unused", base_url=url)
    response = client.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, return_documents=True)
    assert [r.index for r in response.results] == ranking(expected)
    assert [r.document.text for r in response.results] == [DOCUMENTS[i] for i in ranking(expected)]


def test_jina_shape_on_v1_rerank(url, reranker):
    expected = reranker[1]
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": True}
    response = httpx.post(f"{url}/v1/rerank", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    assert [r["index"] for r in data["results"]] == ranking(expected)[:2]
    assert data["results"][0]["document"]["text"] == DOCUMENTS[ranking(expected)[0]]
    assert data["usage"]["total_tokens"] > 0 and data["model"] == MODEL


def test_tei_rerank_with_raw_scores_and_texts(url, reranker):
    expected = reranker[1]
    logits = np.log(expected / (1 - expected))
    body = {"query": QUERY, "texts": DOCUMENTS, "raw_scores": True, "return_text": True}
    response = httpx.post(f"{url}/rerank", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()  # a bare list, best first
    assert [r["index"] for r in data] == ranking(expected)
    assert max(abs(r["score"] - logits[r["index"]]) for r in data) <= 1e-4
    assert all(r["text"] == DOCUMENTS[r["index"]] for r in data)


def test_native_score_in_msgpack_echoes_ids_and_ranks(url, reranker):
    expected = reranker[1]
    body = {
        "model": MODEL,
        "query": {"text": QUERY},
        "items": [{"id": f"d{i}", "text": d} for i, d in enumerate(DOCUMENTS)],
        "top_k": 4,
    }
    response = httpx.post(
        f"{url}/v1/score",
        content=msgspec.msgpack.encode(body),
        timeout=60,
        headers={"Content-Type": "application/msgpack"},
    )
    assert response.status_code == 200, response.text
    data = msgspec.msgpack.decode(response.content)
    assert [item["index"] for item in data["items"]] == ranking(expected)[:4]
    assert [item["id"] for item in data["items"]] == [f"d{i}" for i in ranking(expected)[:4]]
    assert data["usage"]["tokens"] > 0 and set(data["timings"]) >= {"tokenize_ms", "queue_ms", "inference_ms"}


@pytest.mark.parametrize(
    "body, status, words",
    [
        (
            {"model": MODEL, "query": {"text": QUERY}, "items": [{"text": "x " * 400}], "options": {"truncate": False}},
            422,
            "longer than the model's max_length",
        ),
        (
            {
                "model": "sentence-transformers/all-MiniLM-L6-v2",
                "query": QUERY,
                "items": [{"text": "a"}],
                "options": {"window_overlap_tokens": 4},
            },
            400,
            "applies to cross-encoders",
        ),
    ],
)
def test_native_score_refusals_from_the_engine(url, body, status, words):
    response = httpx.post(f"{url}/v1/score", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_tei_rerank_without_a_model_prefers_a_preloaded_reranker_to_an_embedder(serve, reranker):
    """An embedder scores too, but a route that names no model takes the reranker even when the
    embedder was preloaded first."""
    url = serve(preload=("sentence-transformers/all-MiniLM-L6-v2", MODEL), cards_dirs=(reranker[0],))
    response = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCUMENTS}, timeout=60)
    assert response.status_code == 200, response.text
    expected = reranker[1]
    assert max(abs(r["score"] - expected[r["index"]]) for r in response.json()) <= 1e-5
