"""Other servers' route shapes, each driven by the client that sends it where one installs from PyPI:

- Infinity's and vLLM's rerank body on `/rerank` (litellm's `infinity/` provider; its `hosted_vllm/`
  provider on `/v1/rerank`, whose document objects are vLLM's), beside TEI's `texts` body;
- `/embeddings`, OpenAI's body without `/v1` (litellm's `infinity/` and `hosted_vllm/` providers);
- vLLM's `/score` (`text_1`, `text_2`: its documented bodies, no client sends them);
- the Hugging Face Inference API's token and zero-shot classification bodies on `POST /`
  (`huggingface_hub`'s `InferenceClient`), against transformers' pipelines on the same weights;
- TEI's `/decode`, against the model's tokenizer in transformers.

The rerank, score and embeddings routes run over `standin.StandIn` (torch-free), each expected answer
recomputed from its scorer and vectors; the rest over the real engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from conftest import MODEL_ID, need_tool, running_server
from standin import RERANK_MODEL, StandIn

DENSE = "standin/dense-16"
QUERY = "cat sat on mat"
DOCS = ["the dog sat on a rug", "a cat sat on the mat", "fish swim in the sea", "on the mat a cat slept"]


def ranked(query: str, docs: list[str], raw_scores: bool = False) -> list[tuple[int, float]]:
    """(index, score) best first, ties by index, as the stand-in scores each document."""
    scored = [StandIn.score(query, doc, index=i, raw_scores=raw_scores)[0] for i, doc in enumerate(docs)]
    return [(s.index, s.score) for s in sorted(scored, key=lambda s: (-s.score, s.index))]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from shoal.api import create_app
    from shoal.config import Settings

    with running_server(create_app(Settings(), StandIn(), preload=(DENSE, RERANK_MODEL))) as base:
        yield base


@pytest.fixture(scope="module")
def litellm():
    """litellm as a user runs it, offline: its model price map from the package, not the network."""
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError:
        need_tool(False, "litellm is not installed (the dev extra installs it)")
    litellm.suppress_debug_info = True
    return litellm


# --- rerank -----------------------------------------------------------------------------------------


def test_litellm_infinity_rerank_gets_infinitys_results_with_text_documents(url, litellm):
    response = litellm.rerank(
        model=f"infinity/{RERANK_MODEL}", query=QUERY, documents=DOCS, top_n=3, return_documents=True, api_base=url
    )
    expected = ranked(QUERY, DOCS)[:3]
    assert [(r["index"], round(r["relevance_score"], 6)) for r in response.results] == [
        (i, round(s, 6)) for i, s in expected
    ]
    assert [r["document"]["text"] for r in response.results] == [DOCS[i] for i, _ in expected]


def test_litellm_hosted_vllm_rerank_reads_v1_rerank_and_rerank_without_documents(url, litellm):
    expected = ranked(QUERY, DOCS)
    on_v1 = litellm.rerank(model=f"hosted_vllm/{RERANK_MODEL}", query=QUERY, documents=DOCS, api_base=f"{url}/v1")
    assert [(r["index"], round(r["relevance_score"], 6)) for r in on_v1.results] == [
        (i, round(s, 6)) for i, s in expected
    ]
    assert [r["document"]["text"] for r in on_v1.results] == [DOCS[i] for i, _ in expected]
    bare = litellm.rerank(
        model=f"hosted_vllm/{RERANK_MODEL}", query=QUERY, documents=DOCS, return_documents=False, api_base=url
    )
    assert [r["index"] for r in bare.results] == [i for i, _ in expected]


def test_rerank_answers_teis_list_for_texts_and_infinitys_object_for_documents(url):
    tei = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    assert [(r["index"], r["score"]) for r in tei] == ranked(QUERY, DOCS, raw_scores=True)
    body = {"model": RERANK_MODEL, "query": QUERY, "documents": DOCS, "top_n": 0, "raw_scores": True}
    infinity = httpx.post(f"{url}/rerank", json=body)
    assert infinity.status_code == 200 and infinity.headers["x-shoal-model"] == RERANK_MODEL
    answer = infinity.json()
    assert answer["object"] == "rerank" and answer["model"] == RERANK_MODEL and answer["id"]
    assert [(r["index"], r["relevance_score"]) for r in answer["results"]] == ranked(QUERY, DOCS, raw_scores=True)
    assert all("document" not in r for r in answer["results"])  # return_documents defaults to false
    assert answer["usage"]["total_tokens"] == sum(StandIn.score(QUERY, d)[1] for d in DOCS)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"query": QUERY}, "`texts` (TEI's request"),
        ({"query": QUERY, "texts": DOCS, "documents": DOCS}, "one of them"),
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": QUERY, "documents": [{"text": "a"}]}, "documents[0]"),
        ({"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ],
)
def test_a_bad_rerank_body_is_a_400_naming_what_to_fix(url, body, words):
    response = httpx.post(f"{url}/rerank", json=body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


# --- embeddings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["infinity", "hosted_vllm"])
def test_litellm_embeddings_on_unprefixed_embeddings_are_the_standins_vectors(url, litellm, provider):
    texts = ["a shoal of fish", "ünïcödé 🐟"]
    response = litellm.embedding(model=f"{provider}/{DENSE}", input=texts, api_base=url)
    got = np.array([d["embedding"] for d in response.data])
    assert np.abs(got - np.stack([StandIn.vector(DENSE, t) for t in texts])).max() <= 1e-6
    same = httpx.post(f"{url}/v1/embeddings", json={"model": DENSE, "input": texts}).json()
    assert [d["embedding"] for d in same["data"]] == [d["embedding"] for d in response.data]


# --- vLLM's /score ----------------------------------------------------------------------------------


def test_vllm_score_one_text_1_against_every_text_2_in_text_2s_order(url):
    answer = httpx.post(f"{url}/score", json={"model": RERANK_MODEL, "text_1": QUERY, "text_2": DOCS}).json()
    assert answer["object"] == "list" and answer["model"] == RERANK_MODEL and answer["id"]
    assert [d["index"] for d in answer["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in answer["data"])
    assert [d["score"] for d in answer["data"]] == [StandIn.score(QUERY, doc)[0].score for doc in DOCS]
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    as_list = httpx.post(f"{url}/score", json={"text_1": [QUERY], "text_2": DOCS}).json()  # default model
    assert as_list["data"] == answer["data"]
    one = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS[1], "use_activation": False}).json()
    assert [d["score"] for d in one["data"]] == [StandIn.score(QUERY, DOCS[1], raw_scores=True)[0].score]


def test_vllm_score_as_many_text_1_as_text_2_scores_pairwise(url):
    queries = ["dog rug", "cat mat", "sea fish", "slept"]
    answer = httpx.post(f"{url}/score", json={"text_1": queries, "text_2": DOCS}).json()
    assert [d["index"] for d in answer["data"]] == [0, 1, 2, 3]
    assert [d["score"] for d in answer["data"]] == [StandIn.score(q, d)[0].score for q, d in zip(queries, DOCS)]
    assert answer["usage"]["total_tokens"] == sum(StandIn.score(q, d)[1] for q, d in zip(queries, DOCS))


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "send one text_1"),
        ({"text_1": [], "text_2": ["a"]}, 400, "text_1"),
        ({"text_1": "a", "text_2": ["a"], "truncate_prompt_tokens": 4}, 400, "truncate_prompt_tokens"),
        ({"model": DENSE, "text_1": "a", "text_2": ["a"]}, 400, "does not score"),
        ({"model": "no/such-model", "text_1": "a", "text_2": ["a"]}, 404, "no/such-model"),
    ],
)
def test_a_bad_vllm_score_body_is_a_4xx_naming_what_to_fix(url, body, status, words):
    response = httpx.post(f"{url}/score", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_the_native_v1_score_still_reads_its_own_body(url):
    body = {"model": RERANK_MODEL, "query": QUERY, "items": [{"id": i, "text": d} for i, d in enumerate(DOCS)]}
    answer = httpx.post(f"{url}/v1/score", json=body).json()
    assert [(item["index"], item["score"]) for item in answer["items"]] == ranked(QUERY, DOCS)


# --- Hugging Face task bodies on POST /, and /decode, on the real engine -----------------------------

TEXTS = ["Angela Merkel met Barack Obama in Berlin on Monday.", "Apple Inc. hired Tim Cook in Cupertino, California."]


@pytest.fixture(scope="module")
def extractors(tmp_path_factory):
    """A token classifier and an NLI zero-shot classifier (random weights), their cards, and the
    transformers pipelines on the same weights."""
    import transformers

    from extract_models import build_nli, build_token_classifier, extract_card

    root = tmp_path_factory.mktemp("peer-extract")
    tagger = build_token_classifier(root / "tagger", seed=3)
    nli = build_nli(root / "nli", ["contradiction", "entailment", "neutral"], seed=4)
    cards = root / "cards"
    cards.mkdir()
    (cards / "tagger.yaml").write_text(extract_card(root / "tagger", "test/peer-tagger", "token_class"))
    (cards / "nli.yaml").write_text(extract_card(root / "nli", "test/peer-nli", "zero_shot"))
    pipelines = {
        "tagger": lambda strategy: transformers.pipeline(
            "token-classification", model=tagger[0], tokenizer=tagger[1], aggregation_strategy=strategy, device="cpu"
        ),
        "nli": transformers.pipeline("zero-shot-classification", model=nli[0], tokenizer=nli[1], device="cpu"),
    }
    return cards, pipelines


@pytest.fixture(scope="module")
def engine_url(serve, extractors) -> str:
    return serve(preload=(MODEL_ID, "test/peer-tagger", "test/peer-nli"), cards_dirs=(extractors[0],))


@pytest.fixture
def hf(engine_url, monkeypatch):
    """The client as a user runs it; HF_HUB_OFFLINE is lifted for this loopback server only."""
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    return InferenceClient(model=engine_url, timeout=120)


@pytest.mark.parametrize("strategy", ["simple", "max"])
def test_huggingface_hub_token_classification_equals_the_transformers_pipeline(hf, extractors, strategy):
    pipe = extractors[1]["tagger"](strategy)
    total = 0
    for text in TEXTS:
        got = hf.token_classification(text, aggregation_strategy=strategy)
        expected = pipe(text)
        assert [(e.entity_group, e.start, e.end) for e in got] == [
            (e["entity_group"], e["start"], e["end"]) for e in expected
        ]
        assert all(abs(e.score - float(x["score"])) <= 1e-4 for e, x in zip(got, expected))
        assert all(e.word == text[e.start : e.end] for e in got)
        total += len(got)
    assert total > 3
    kept = hf.token_classification(TEXTS[0], aggregation_strategy=strategy, ignore_labels=["PER"])
    assert [e.entity_group for e in kept] == [e["entity_group"] for e in pipe(TEXTS[0]) if e["entity_group"] != "PER"]


@pytest.mark.parametrize("multi_label", [False, True])
def test_huggingface_hub_zero_shot_classification_equals_the_transformers_pipeline(hf, extractors, multi_label):
    labels = ["politics", "technology", "food"]
    template = "The topic is {}."
    got = hf.zero_shot_classification(TEXTS[1], labels, multi_label=multi_label, hypothesis_template=template)
    pipe = extractors[1]["nli"]
    expected = pipe(TEXTS[1], candidate_labels=labels, multi_label=multi_label, hypothesis_template=template)
    assert [e.label for e in got] == expected["labels"]
    np.testing.assert_allclose([e.score for e in got], expected["scores"], atol=1e-4)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"inputs": "x", "parameters": {"aggregation_strategy": "none"}}, 'aggregation_strategy "none"'),
        ({"inputs": "x", "parameters": {"candidate_labels": []}}, "candidate_labels"),
        ({"inputs": ["x"], "parameters": {}}, "inputs"),
        ({"inputs": "x", "parameters": {"top_k": 0}}, "top_k"),
    ],
)
def test_a_bad_huggingface_task_body_is_a_400_naming_what_to_fix(engine_url, body, words):
    response = httpx.post(f"{engine_url}/", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_root_still_embeds_a_body_without_parameters(engine_url, embed_reference):
    embedded = httpx.post(f"{engine_url}/", json={"inputs": TEXTS[0]}, timeout=60)
    assert embedded.headers["x-shoal-model"] == MODEL_ID
    assert np.abs(np.array(embedded.json()) - embed_reference(TEXTS[:1])).max() <= 1e-5


def test_decode_equals_the_models_tokenizer_and_inverts_tokenize(engine_url, model_dir):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    sequences = [tokenizer(t)["input_ids"] for t in ["Shoals of fish, naïve café!", "Decode this."]]
    one = httpx.post(f"{engine_url}/decode", json={"ids": sequences[0]}).json()
    assert one == [tokenizer.decode(sequences[0], skip_special_tokens=True)]
    both = httpx.post(f"{engine_url}/decode", json={"ids": sequences, "skip_special_tokens": False}).json()
    assert both == [tokenizer.decode(s, skip_special_tokens=False) for s in sequences]
    assert both[0].startswith("[CLS]") and "shoals of fish" in one[0]
    tokens = httpx.post(f"{engine_url}/tokenize", json={"inputs": "Decode this."}).json()[0]
    assert [t["id"] for t in tokens] == sequences[1]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"ids": [101, 10**6]}, "token id 1000000 (sequence 0, position 1)"),
        ({"ids": [[101], 7]}, "mixes token ids and lists"),
        ({"ids": []}, "ids"),
        ({"ids": [-1]}, "ids"),
    ],
)
def test_a_bad_decode_body_is_a_400_naming_what_to_fix(engine_url, body, words):
    response = httpx.post(f"{engine_url}/decode", json=body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
