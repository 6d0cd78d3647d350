"""Never silently cut (issue 34): every route family says which inputs were cut at the model's
max_length (native: each item's `truncated`; every route: the `x-shoal-truncated` answer header,
the cut items' indices), and `truncate: false` refuses an over-long input with a 422 on each
family. Real clients (openai, cohere, huggingface_hub's transport) against a real server."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from conftest import MODEL_ID

SHORT = "a shoal of small fish"
LONG = "the quick brown fox jumps over the lazy dog " * 120  # ~1,100 tokens; MiniLM takes 256


def test_native_encode_marks_each_cut_item_and_the_header_lists_them(base_url, embed_reference):
    body = {"model": MODEL_ID, "items": [{"text": SHORT}, {"text": LONG}, {"text": SHORT}]}
    answer = httpx.post(f"{base_url}/v1/encode", json=body, timeout=60)
    items = answer.json()["items"]
    assert [item.get("truncated", False) for item in items] == [False, True, False]
    assert answer.headers["x-shoal-truncated"] == "1"
    # What was cut is what sentence-transformers computes (it cuts at max_length too).
    assert np.abs(np.array(items[1]["dense"]) - embed_reference([LONG])[0]).max() <= 1e-5
    whole = httpx.post(f"{base_url}/v1/encode", json={"model": MODEL_ID, "items": [{"text": SHORT}]}, timeout=60)
    assert "x-shoal-truncated" not in whole.headers and "truncated" not in whole.json()["items"][0]


def test_native_truncate_false_refuses_an_over_long_text(base_url):
    body = {"model": MODEL_ID, "items": [{"text": LONG}], "options": {"truncate": False}}
    refused = httpx.post(f"{base_url}/v1/encode", json=body, timeout=60)
    assert refused.status_code == 422, refused.text


def test_openai_route_says_what_it_cut_in_a_header_and_refuses_when_told_not_to_cut(openai_client):
    import openai

    raw = openai_client.embeddings.with_raw_response.create(model=MODEL_ID, input=[LONG, SHORT])
    assert raw.headers["x-shoal-truncated"] == "0" and len(raw.parse().data) == 2
    with pytest.raises(openai.UnprocessableEntityError):
        openai_client.embeddings.create(model=MODEL_ID, input=[LONG], extra_body={"truncate": False})


def test_cohere_route_says_what_it_cut_and_truncate_none_refuses(base_url):
    cohere = pytest.importorskip("cohere", reason="needs the cohere client")
    from cohere.errors import UnprocessableEntityError

    co = cohere.ClientV2(base_url=base_url, api_key="x")
    raw = co.with_raw_response.embed(
        model=MODEL_ID, texts=[SHORT, LONG], input_type="search_document", embedding_types=["float"]
    )
    assert raw.headers["x-shoal-truncated"] == "1"
    with pytest.raises(UnprocessableEntityError):
        co.embed(model=MODEL_ID, texts=[LONG], input_type="search_document", embedding_types=["float"], truncate="NONE")


def test_tei_cuts_only_when_asked_and_then_says_so(base_url):
    refused = httpx.post(f"{base_url}/embed", json={"inputs": [LONG]}, timeout=60)
    assert refused.status_code == 422  # TEI's default: truncate false
    cut = httpx.post(f"{base_url}/embed", json={"inputs": [SHORT, LONG], "truncate": True}, timeout=60)
    assert cut.status_code == 200 and cut.headers["x-shoal-truncated"] == "1"


def test_score_says_which_documents_were_cut(base_url):
    body = {"model": MODEL_ID, "query": {"text": "fox"}, "items": [{"text": SHORT}, {"text": LONG}]}
    answer = httpx.post(f"{base_url}/v1/score", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    cut = {item["index"] for item in answer.json()["items"] if item.get("truncated")}
    assert cut == {1} and answer.headers["x-shoal-truncated"] == "1"


def test_auto_truncate_makes_teis_routes_cut_unless_the_body_says_otherwise(serve):
    from shoal.config import ServerSettings

    url = serve(server=ServerSettings(auto_truncate=True))
    cut = httpx.post(f"{url}/embed", json={"inputs": [LONG, SHORT]}, timeout=60)
    assert cut.status_code == 200 and cut.headers["x-shoal-truncated"] == "0"
    assert httpx.post(f"{url}/embed", json={"inputs": [LONG], "truncate": False}, timeout=60).status_code == 422
    ranked = httpx.post(f"{url}/rerank", json={"query": "fox", "texts": [SHORT, LONG]}, timeout=60)
    assert ranked.status_code == 200 and ranked.headers["x-shoal-truncated"] == "1"
