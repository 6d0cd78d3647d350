"""The score routes over real HTTP: native `/v1/score`, Cohere `/v1|v2/rerank` (with the real `cohere`
client), Jina's shape on `/v1/rerank`, TEI's `/rerank`, and their refusals.

The servers are real uvicorn over `standin.StandIn` (torch-free), started once for the module. Every
expected ranking is recomputed here from the stand-in's own pair scorer (`StandIn.score`), so a
route that drops, reorders, re-scores or mislabels an item fails.
"""

from __future__ import annotations

import importlib.util

import httpx
import msgspec
import pytest

from conftest import running_server
from standin import RERANK_MAX_LENGTH, RERANK_MODEL, StandIn

DENSE = "standin/dense-16"  # encodes, does not score
MAX_ITEMS = 8
QUERY = "cat sat on mat"
DOCS = [
    "the dog sat on a rug",
    "a cat sat on the mat",
    "fish swim in the sea",
    "the cat ate",
    "on the mat a cat slept",
]
# 14 words: past the 9 document words a pair with QUERY holds; its matching words are at the end.
LONG = "alpha beta gamma delta epsilon zeta eta theta iota kappa cat sat on mat"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # an import blocker (tests/test_light_install.py) says so by raising
        return False


needs_cohere = pytest.mark.skipif(not _installed("cohere"), reason="needs the cohere client")


def expected(query: str, docs: list[str], top_k: int | None = None, **options) -> list[tuple[int, float]]:
    """(index, score) best first, ties by index, as the stand-in scores each document alone."""
    scored = [StandIn.score(query, doc, index=i, **options)[0] for i, doc in enumerate(docs)]
    return [(s.index, s.score) for s in sorted(scored, key=lambda s: (-s.score, s.index))][:top_k]


def tokens(query: str, docs: list[str], **options) -> int:
    return sum(StandIn.score(query, doc, index=i, **options)[1] for i, doc in enumerate(docs))


@pytest.fixture(scope="module")
def standin() -> StandIn:
    return StandIn()


@pytest.fixture(scope="module")
def url(standin):
    from shoal.api import create_app
    from shoal.config import ServerSettings, Settings

    settings = Settings(server=ServerSettings(max_items_per_request=MAX_ITEMS), allow_download=False)
    # The encode-only model comes first: the default scoring model is the first preloaded one that scores.
    with running_server(create_app(settings, standin, preload=(DENSE, RERANK_MODEL))) as base:
        yield base


@pytest.fixture(scope="module")
def url_without_scorer():
    from shoal.api import create_app
    from shoal.config import Settings

    with running_server(create_app(Settings(allow_download=False), StandIn(), preload=(DENSE,))) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=30.0) as client:
        yield client


def test_the_expected_ranking_is_not_trivial():
    # The tests below compare with this ranking: one equal to request order, or with tied scores, proves less.
    ranking = expected(QUERY, DOCS)
    assert [i for i, _ in ranking] == [1, 4, 0, 3, 2]
    assert len({score for _, score in ranking}) == len(DOCS)


# --- native /v1/score ---------------------------------------------------------------------------


@pytest.mark.light
def test_native_score_ranks_items_best_first_and_echoes_each_items_id_in_json(http):
    ids = ["a", 7, None, "d", -(2**63)]
    items = [{"text": t} if i is None else {"id": i, "text": t} for i, t in zip(ids, DOCS)]
    r = http.post("/v1/score", json={"model": RERANK_MODEL, "query": {"text": QUERY}, "items": items})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == RERANK_MODEL
    assert [(item["index"], item["score"]) for item in body["items"]] == expected(QUERY, DOCS)
    assert [item["id"] for item in body["items"]] == [ids[item["index"]] for item in body["items"]]
    assert all("truncated" not in item and "num_windows" not in item for item in body["items"])
    assert body["usage"] == {"tokens": tokens(QUERY, DOCS)}
    assert body["timings"]["total_ms"] > 0


@pytest.mark.light
def test_native_score_in_msgpack_takes_a_bare_query_string_and_keeps_top_k(http):
    request = {"model": RERANK_MODEL, "query": QUERY, "items": [{"text": t} for t in DOCS], "top_k": 2}
    r = http.post(
        "/v1/score",
        content=msgspec.msgpack.encode(request),
        headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/msgpack")
    body = msgspec.msgpack.decode(r.content)
    assert [(item["index"], item["score"]) for item in body["items"]] == expected(QUERY, DOCS, top_k=2)
    assert [item["id"] for item in body["items"]] == [None, None]


@pytest.mark.light
def test_native_score_options_reach_the_call_and_shape_the_scores(http, standin):
    options = {
        "raw_scores": True,
        "truncate": False,
        "max_tokens_per_doc": 20,
        "window_overlap_tokens": 2,
        "timeout_s": 12.5,
    }
    docs = [DOCS[2], LONG]
    r = http.post(
        "/v1/score",
        headers={"x-request-id": "score-opts-1"},
        json={"model": RERANK_MODEL, "query": QUERY, "items": [{"text": t} for t in docs], "options": options},
    )
    assert r.status_code == 200, r.text
    call = standin.calls[-1]
    assert (
        call.raw_scores,
        call.truncate,
        call.max_tokens_per_doc,
        call.window_overlap_tokens,
        call.timeout_s,
        call.request_id,
    ) == (True, False, 20, 2, 12.5, "score-opts-1")
    items = r.json()["items"]
    # Raw scores are the stand-in's logits (the 4/4 window scores 2.0, no overlap -2.0); LONG needed 2 windows.
    assert [(item["index"], item["score"]) for item in items] == [(1, 2.0), (0, -2.0)]
    assert items[0]["num_windows"] == 2 and "truncated" not in items[0]

    # `instruction` reaches the service too: the stand-in, a cross-encoder, refuses it as the engine does.
    r = http.post(
        "/v1/score",
        json={
            "model": RERANK_MODEL,
            "query": QUERY,
            "items": [{"text": DOCS[0]}],
            "options": {"instruction": "find cats"},
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"instruction applies to LLM rerankers; model {RERANK_MODEL} scores by a cross-encoder"
    )


@pytest.mark.light
def test_native_score_marks_a_cut_item_truncated_and_scores_what_was_kept(http):
    r = http.post("/v1/score", json={"model": RERANK_MODEL, "query": QUERY, "items": [{"id": "long", "text": LONG}]})
    assert r.status_code == 200, r.text
    (item,) = r.json()["items"]
    assert item == {"id": "long", "index": 0, "score": expected(QUERY, [LONG])[0][1], "truncated": True}
    assert item["score"] == StandIn.pair_score(QUERY, [])  # the matching words were cut off


@pytest.mark.light
def test_native_score_refuses_a_too_long_item_with_422_when_truncate_is_false(http):
    r = http.post(
        "/v1/score",
        json={
            "model": RERANK_MODEL,
            "query": QUERY,
            "options": {"truncate": False},
            "items": [{"text": DOCS[0]}, {"text": LONG}],
        },
    )
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["code"] == "input_too_long"
    assert f"pairs[1] is longer than the model's max_length of {RERANK_MAX_LENGTH} tokens" in error["message"]


BAD_SCORE_REQUESTS = {
    "no items": ({"model": RERANK_MODEL, "query": QUERY, "items": []}, 400, "at `$.items`"),
    "empty query": ({"model": RERANK_MODEL, "query": "", "items": [{"text": "x"}]}, 400, "at `$.query`"),
    "empty query text": (
        {"model": RERANK_MODEL, "query": {"text": ""}, "items": [{"text": "x"}]},
        400,
        "at `$.query.text`",
    ),
    "blank query": ({"model": RERANK_MODEL, "query": "   ", "items": [{"text": "x"}]}, 400, "the query is empty"),
    "top_k zero": (
        {"model": RERANK_MODEL, "query": QUERY, "items": [{"text": "x"}], "top_k": 0},
        400,
        "Expected `int` >= 1 - at `$.top_k`",
    ),
    "unknown option": (
        {"model": RERANK_MODEL, "query": QUERY, "items": [{"text": "x"}], "options": {"top_n": 1}},
        400,
        "unknown field `top_n` - at `$.options`",
    ),
    "unknown item field": (
        {"model": RERANK_MODEL, "query": QUERY, "items": [{"text": "x", "title": "t"}]},
        400,
        "unknown field `title` - at `$.items[0]`",
    ),
    "too many items": (
        {"model": RERANK_MODEL, "query": QUERY, "items": [{"text": "x"}] * (MAX_ITEMS + 1)},
        400,
        f"{MAX_ITEMS + 1} items in one request; the limit is {MAX_ITEMS}",
    ),
    "model that only encodes": (
        {"model": DENSE, "query": QUERY, "items": [{"text": "x"}]},
        400,
        f"model {DENSE} does not score; it serves: encode",
    ),
    "unknown model": ({"model": "no/such-model", "query": QUERY, "items": [{"text": "x"}]}, 404, "no/such-model"),
}


@pytest.mark.light
@pytest.mark.parametrize("case", BAD_SCORE_REQUESTS, ids=list(BAD_SCORE_REQUESTS))
def test_native_score_refuses_bad_input_with_a_4xx_naming_the_problem(http, case):
    body, status, fragment = BAD_SCORE_REQUESTS[case]
    r = http.post("/v1/score", json=body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


@pytest.mark.light
def test_encoding_with_a_reranker_is_refused_as_the_engine_words_it(http):
    r = http.post("/v1/encode", json={"model": RERANK_MODEL, "items": [{"text": "x"}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"model {RERANK_MODEL} does not encode; it serves: score"


@pytest.mark.light
def test_models_lists_the_reranker_with_only_the_score_task(http):
    tasks = {m["id"]: m["tasks"] for m in http.get("/v1/models").json()["data"]}
    assert tasks[RERANK_MODEL] == ["score"] and tasks[DENSE] == ["encode"]


# --- Cohere v2 and v1, with the real client ------------------------------------------------------


@needs_cohere
def test_the_cohere_v2_client_gets_the_ranking_cut_to_top_n_with_the_request_id(url):
    import cohere

    client = cohere.ClientV2(api_key="x", base_url=url, timeout=30)
    response = client.rerank(
        model=RERANK_MODEL,
        query=QUERY,
        documents=DOCS,
        top_n=3,
        request_options={"additional_headers": {"x-request-id": "cohere-v2-1"}},
    )
    assert [(r.index, r.relevance_score) for r in response.results] == expected(QUERY, DOCS, top_k=3)
    assert all(getattr(r, "document", None) is None for r in response.results)  # not asked for
    assert response.id == "cohere-v2-1"
    assert response.meta.api_version.version == "2" and response.meta.billed_units.search_units == 1


@needs_cohere
def test_the_cohere_v1_client_ranks_strings_and_objects_and_gets_documents_when_asked(url, standin):
    import cohere

    client = cohere.Client(api_key="x", base_url=url, timeout=30)
    documents = [DOCS[0], {"text": DOCS[1], "source": "b"}, DOCS[2]]
    response = client.rerank(query=QUERY, documents=documents, top_n=2, return_documents=True)  # no model
    assert standin.calls[-1].model == RERANK_MODEL  # the server's default scoring model
    assert [(r.index, r.relevance_score) for r in response.results] == expected(QUERY, DOCS[:3], top_k=2)
    assert [r.document.text for r in response.results] == [DOCS[1], DOCS[0]]
    assert response.results[0].document.source == "b"  # an object comes back whole
    assert response.meta.api_version.version == "1"

    bare = client.rerank(model=RERANK_MODEL, query=QUERY, documents=DOCS)
    assert [(r.index, r.relevance_score) for r in bare.results] == expected(QUERY, DOCS)
    assert all(r.document is None for r in bare.results)  # return_documents defaults to false


@needs_cohere
def test_the_cohere_v1_client_ranks_objects_by_rank_fields_in_their_order(url, standin):
    import cohere

    client = cohere.Client(api_key="x", base_url=url, timeout=30)
    documents = [{"title": "fish", "body": "swim in the sea"}, {"title": "cat", "body": "sat on the mat"}]
    response = client.rerank(
        model=RERANK_MODEL, query=QUERY, documents=documents, rank_fields=["title", "body"], max_chunks_per_doc=4
    )  # accepted, ignored
    texts = ["title: fish\nbody: swim in the sea", "title: cat\nbody: sat on the mat"]
    assert standin.calls[-1].documents == texts
    assert [(r.index, r.relevance_score) for r in response.results] == expected(QUERY, texts)


@needs_cohere
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_cohere_client_sees_400_naming_top_n_documents_or_the_model(url, version):
    import cohere
    from cohere.errors import BadRequestError

    client = cohere.Client(api_key="x", base_url=url) if version == "v1" else cohere.ClientV2(api_key="x", base_url=url)
    cases = [
        ({"model": RERANK_MODEL, "query": QUERY, "documents": DOCS, "top_n": 0}, "at `$.top_n`"),
        ({"model": RERANK_MODEL, "query": QUERY, "documents": []}, "at `$.documents`"),
        ({"model": RERANK_MODEL, "query": "", "documents": DOCS}, "at `$.query`"),
        ({"model": DENSE, "query": QUERY, "documents": DOCS}, f"model {DENSE} does not score; it serves: encode"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(BadRequestError) as raised:
            client.rerank(**kwargs)
        assert raised.value.status_code == 400
        assert fragment in raised.value.body["error"]["message"], kwargs


@pytest.mark.light
def test_cohere_v2_returns_documents_only_when_asked_and_passes_max_tokens_per_doc(http, standin):
    body = {
        "model": RERANK_MODEL,
        "query": QUERY,
        "documents": [DOCS[0], {"text": LONG}],
        "return_documents": True,
        "max_tokens_per_doc": 11,
        "priority": 3,
        "relevant_spans": {"mode": "disabled"},
    }
    r = http.post("/v2/rerank", json=body)
    assert r.status_code == 200, r.text
    assert standin.calls[-1].max_tokens_per_doc == 11
    results = r.json()["results"]
    assert [(x["index"], x["relevance_score"]) for x in results] == expected(
        QUERY, [DOCS[0], LONG], max_tokens_per_doc=11
    )
    assert [x["document"] for x in results] == [{"text": [DOCS[0], LONG][x["index"]]} for x in results]

    r = http.post("/v2/rerank", json={**body, "return_documents": False})
    assert all("document" not in x for x in r.json()["results"])


@pytest.mark.light
def test_cohere_v2_refuses_relevant_spans_and_a_missing_model(http):
    base = {"model": RERANK_MODEL, "query": QUERY, "documents": DOCS}
    r = http.post("/v2/rerank", json={**base, "relevant_spans": {"mode": "enabled"}})
    assert r.status_code == 400 and "relevant_spans mode 'enabled' is not supported" in r.json()["error"]["message"]
    r = http.post("/v2/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and "missing required field `model`" in r.json()["error"]["message"]
    r = http.post("/v2/rerank", json={**base, "documents": [{"title": "no text"}]})
    assert r.status_code == 400 and "documents[0] has no field 'text'" in r.json()["error"]["message"]


@pytest.mark.light
def test_cohere_rerank_refuses_more_documents_than_the_item_limit(http):
    r = http.post("/v2/rerank", json={"model": RERANK_MODEL, "query": QUERY, "documents": ["x"] * (MAX_ITEMS + 1)})
    assert r.status_code == 400
    assert f"the limit is {MAX_ITEMS}" in r.json()["error"]["message"]


# --- Jina, on /v1/rerank -------------------------------------------------------------------------


@pytest.mark.light
def test_jinas_request_shape_gets_a_body_with_jina_and_cohere_fields(http):
    r = http.post(
        "/v1/rerank",
        headers={"x-request-id": "jina-1"},
        json={"model": RERANK_MODEL, "query": QUERY, "documents": DOCS, "top_n": 3, "return_documents": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == RERANK_MODEL
    assert body["usage"] == {"total_tokens": tokens(QUERY, DOCS), "prompt_tokens": tokens(QUERY, DOCS)}
    assert [(x["index"], x["relevance_score"]) for x in body["results"]] == expected(QUERY, DOCS, top_k=3)
    assert [x["document"] for x in body["results"]] == [{"text": DOCS[x["index"]]} for x in body["results"]]
    assert body["id"] == "jina-1"  # Cohere v1's fields, in the same body
    assert body["meta"] == {"api_version": {"version": "1"}, "billed_units": {"search_units": 1}}


# --- TEI /rerank ---------------------------------------------------------------------------------


@pytest.mark.light
def test_tei_rerank_answers_a_bare_list_sorted_by_score_from_the_default_scoring_model(http, standin):
    r = http.post("/rerank", json={"query": QUERY, "texts": DOCS})
    assert r.status_code == 200, r.text
    ranks = r.json()
    assert isinstance(ranks, list)
    assert [(x["index"], x["score"]) for x in ranks] == expected(QUERY, DOCS)
    assert all("text" not in x for x in ranks)
    call = standin.calls[-1]
    assert call.model == RERANK_MODEL and call.truncate is False and call.raw_scores is False  # TEI's defaults


@pytest.mark.light
def test_tei_rerank_returns_texts_and_raw_scores_when_asked(http):
    r = http.post(
        "/rerank",
        json={"query": QUERY, "texts": DOCS, "return_text": True, "raw_scores": True, "truncation_direction": "Right"},
    )
    assert r.status_code == 200, r.text
    ranks = r.json()
    assert [(x["index"], x["score"]) for x in ranks] == expected(QUERY, DOCS, raw_scores=True)
    assert [x["text"] for x in ranks] == [DOCS[x["index"]] for x in ranks]


@pytest.mark.light
def test_tei_rerank_refuses_a_too_long_text_unless_truncate_is_true(http):
    r = http.post("/rerank", json={"query": QUERY, "texts": [DOCS[0], LONG]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "input_too_long"
    r = http.post("/rerank", json={"query": QUERY, "texts": [DOCS[0], LONG], "truncate": True})
    assert r.status_code == 200
    assert [(x["index"], x["score"]) for x in r.json()] == expected(QUERY, [DOCS[0], LONG])


@pytest.mark.light
@pytest.mark.parametrize("how", ["query", "header"])
def test_tei_rerank_uses_the_model_named_by_query_parameter_or_header(http, how):
    # Naming the encode-only model proves the override is used: the answer is that model's refusal.
    kwargs = {"params": {"model": DENSE}} if how == "query" else {"headers": {"X-Shoal-Model": DENSE}}
    r = http.post("/rerank", json={"query": QUERY, "texts": DOCS}, **kwargs)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"model {DENSE} does not score; it serves: encode"


@pytest.mark.light
@pytest.mark.parametrize("direction", ["Left", "left"])
def test_tei_rerank_refuses_left_truncation(http, direction):
    r = http.post("/rerank", json={"query": QUERY, "texts": DOCS, "truncation_direction": direction})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "truncation_direction" in message and "right only" in message


BAD_TEI_REQUESTS = {
    "no texts": ({"query": QUERY, "texts": []}, "at `$.texts`"),
    "empty query": ({"query": "", "texts": DOCS}, "at `$.query`"),
    "too many texts": ({"query": QUERY, "texts": ["x"] * (MAX_ITEMS + 1)}, f"the limit is {MAX_ITEMS}"),
    "unknown field": ({"query": QUERY, "texts": DOCS, "model": RERANK_MODEL}, "unknown field `model`"),
}


@pytest.mark.light
@pytest.mark.parametrize("case", BAD_TEI_REQUESTS, ids=list(BAD_TEI_REQUESTS))
def test_tei_rerank_refuses_bad_input_with_400_naming_it(http, case):
    body, fragment = BAD_TEI_REQUESTS[case]
    r = http.post("/rerank", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


@pytest.mark.light
@pytest.mark.parametrize(
    "path,body",
    [
        ("/rerank", {"query": QUERY, "texts": DOCS}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS}),
    ],
)
def test_a_request_without_a_model_on_a_server_with_no_scorer_is_told_how_to_pick_one(url_without_scorer, path, body):
    r = httpx.post(url_without_scorer + path, json=body, timeout=30.0)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "no default or preloaded model scores" in error["message"]
    assert "?model=ID" in error["message"] and "X-Shoal-Model" in error["message"]
    assert error["details"] == {"preloaded": [DENSE], "default_model": None}
