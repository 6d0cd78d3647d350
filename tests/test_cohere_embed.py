"""Cohere `/v2/embed` and `/v1/embed` with the real `cohere` client against a real server on the
MiniLM weights: floats equal sentence-transformers', every other embedding type is recomputed here
in numpy from the float vectors of the same response, `input_type` picks the card's prompts (a card
written here over the same weights, with e5-style prompts), and refusals reach the client as 4xx
errors that say what to fix.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

cohere = pytest.importorskip("cohere", reason="needs the cohere client")
from cohere.errors import BadRequestError, NotFoundError, UnprocessableEntityError

DIMS = 384
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Stock markets fell sharply after the central bank's announcement.",
    "naïve café résumé — unicode survives the wire",
]
LONG_TEXT = " ".join(f"word{i}" for i in range(400))  # well over MiniLM's 256 tokens
PROMPT_MODEL = "test/minilm-prompts"
ALL_TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


@pytest.fixture(scope="module")
def co(base_url):
    return cohere.ClientV2(api_key="x", base_url=base_url, timeout=60)


@pytest.fixture(scope="module")
def co_v1(base_url):
    return cohere.Client(api_key="x", base_url=base_url, timeout=60)


@pytest.fixture(scope="module")
def prompt_url(serve, model_dir, tmp_path_factory):
    """A server of a card over the MiniLM folder with a query and a passage prompt."""
    cards = tmp_path_factory.mktemp("cohere-cards")
    (cards / "minilm-prompts.yaml").write_text(
        f"id: {PROMPT_MODEL}\narchitecture: bert\nsource: {{path: '{model_dir}'}}\nmax_length: 256\n"
        "pooling: mean\nnormalize: true\ndimensions: 384\noutputs: [dense]\n"
        "prompts: {query: 'query: ', passage: 'passage: '}\nquery_prompt: query\ndocument_prompt: passage\n"
    )
    return serve(preload=(PROMPT_MODEL,), cards_dirs=(cards,))


def floats(rows) -> np.ndarray:
    return np.asarray(rows, dtype=np.float32)


def message(raised) -> str:
    return raised.value.body["error"]["message"]


# --- floats -------------------------------------------------------------------------------------


def test_v2_float_embeddings_equal_sentence_transformers_with_id_texts_and_billed_tokens(
    co, card, embed_reference, count_tokens
):
    response = co.embed(
        model=card.id,
        texts=TEXTS,
        input_type="search_document",
        embedding_types=["float"],
        request_options={"additional_headers": {"x-request-id": "embed-v2-1"}},
    )

    np.testing.assert_allclose(floats(response.embeddings.float_), embed_reference(TEXTS), atol=1e-5)
    assert response.embeddings.int8 is None and response.embeddings.base64 is None  # not asked for
    assert response.id == "embed-v2-1"
    assert response.texts == TEXTS
    assert response.response_type == "embeddings_by_type"
    assert response.meta.api_version.version == "2"
    assert response.meta.billed_units.input_tokens == sum(count_tokens(t) for t in TEXTS)


def test_v2_defaults_to_float_and_accepts_priority_and_max_tokens_of_the_models_length(co, card, embed_reference):
    response = co.embed(model=card.id, texts=TEXTS[:1], input_type="classification", priority=3, max_tokens=256)
    np.testing.assert_allclose(floats(response.embeddings.float_), embed_reference(TEXTS[:1]), atol=1e-5)
    assert set(response.embeddings.model_dump(exclude_none=True)) == {"float_"}


def test_v2_truncate_end_cuts_a_long_text_as_sentence_transformers_does(co, card, embed_reference):
    response = co.embed(model=card.id, texts=[LONG_TEXT], input_type="search_document", truncate="END")
    np.testing.assert_allclose(floats(response.embeddings.float_), embed_reference([LONG_TEXT]), atol=1e-5)


# --- every embedding type from the same float vector ----------------------------------------------


def test_v2_every_embedding_type_is_derived_from_the_float_vector_of_the_same_response(co, card, embed_reference):
    response = co.embed(model=card.id, texts=TEXTS, input_type="search_document", embedding_types=ALL_TYPES)
    e = response.embeddings
    vectors = floats(e.float_)  # [3, 384]
    np.testing.assert_allclose(vectors, embed_reference(TEXTS), atol=1e-5)

    peak = np.abs(vectors).max(axis=1, keepdims=True)
    int8 = np.clip(np.rint(vectors * (127.0 / peak)), -127, 127).astype(np.int64)
    assert np.asarray(e.int8).tolist() == int8.tolist()
    assert np.abs(int8).max(axis=1).tolist() == [127] * len(TEXTS)
    assert np.asarray(e.uint8).tolist() == (int8 + 128).tolist()
    assert np.asarray(e.uint8).min() >= 1 and np.asarray(e.uint8).max() <= 255

    bits = np.packbits(vectors > 0, axis=1).astype(np.int64)  # [3, 48]
    assert np.asarray(e.ubinary).tolist() == bits.tolist()
    assert np.asarray(e.binary).tolist() == (bits - 128).tolist()
    assert np.asarray(e.binary).shape == (len(TEXTS), DIMS // 8)

    decoded = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in e.base64]
    np.testing.assert_array_equal(np.stack(decoded), vectors)  # the very same float32 values


def test_v2_output_dimension_returns_the_renormalised_prefix_and_types_of_that_length(co, card, embed_reference):
    response = co.embed(
        model=card.id,
        texts=TEXTS,
        input_type="search_document",
        output_dimension=64,
        embedding_types=["float", "ubinary"],
    )
    vectors = floats(response.embeddings.float_)
    prefix = embed_reference(TEXTS)[:, :64]
    np.testing.assert_allclose(vectors, prefix / np.linalg.norm(prefix, axis=1, keepdims=True), atol=1e-5)
    assert np.asarray(response.embeddings.ubinary).tolist() == np.packbits(vectors > 0, axis=1).tolist()


# --- input_type and the card's prompts ---------------------------------------------------------


def test_v2_input_type_picks_the_cards_query_and_passage_prompts(prompt_url, embed_reference):
    co = cohere.ClientV2(api_key="x", base_url=prompt_url, timeout=60)

    def embed(input_type: str) -> np.ndarray:
        return floats(co.embed(model=PROMPT_MODEL, texts=TEXTS, input_type=input_type).embeddings.float_)

    np.testing.assert_allclose(embed("search_query"), embed_reference([f"query: {t}" for t in TEXTS]), atol=1e-5)
    np.testing.assert_allclose(embed("search_document"), embed_reference([f"passage: {t}" for t in TEXTS]), atol=1e-5)
    for no_prompt in ("classification", "clustering"):
        np.testing.assert_allclose(embed(no_prompt), embed_reference(TEXTS), atol=1e-5)


def test_v2_inputs_of_text_content_embed_their_parts_joined_by_newlines(prompt_url, embed_reference):
    co = cohere.ClientV2(api_key="x", base_url=prompt_url, timeout=60)
    inputs = [
        {"content": [{"type": "text", "text": TEXTS[0]}]},
        {"content": [{"type": "text", "text": TEXTS[1]}, {"type": "text", "text": TEXTS[2]}]},
    ]
    response = co.embed(model=PROMPT_MODEL, inputs=inputs, input_type="search_query")
    joined = [TEXTS[0], f"{TEXTS[1]}\n{TEXTS[2]}"]
    assert response.texts == joined
    np.testing.assert_allclose(
        floats(response.embeddings.float_), embed_reference([f"query: {t}" for t in joined]), atol=1e-5
    )


# --- v1 -----------------------------------------------------------------------------------------


def test_v1_without_embedding_types_answers_floats_equal_to_sentence_transformers(co_v1, card, embed_reference):
    response = co_v1.embed(model=card.id, texts=TEXTS, input_type="search_document")
    assert response.response_type == "embeddings_floats"
    np.testing.assert_allclose(floats(response.embeddings), embed_reference(TEXTS), atol=1e-5)
    assert response.texts == TEXTS
    assert response.meta.api_version.version == "1"


def test_v1_with_embedding_types_answers_by_type(co_v1, card, embed_reference):
    response = co_v1.embed(model=card.id, texts=TEXTS, embedding_types=["float", "int8", "base64"])
    assert response.response_type == "embeddings_by_type"
    vectors = floats(response.embeddings.float_)
    np.testing.assert_allclose(vectors, embed_reference(TEXTS), atol=1e-5)
    peak = np.abs(vectors).max(axis=1, keepdims=True)
    assert np.asarray(response.embeddings.int8).tolist() == np.rint(vectors * (127.0 / peak)).astype(int).tolist()
    decoded = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in response.embeddings.base64])
    np.testing.assert_array_equal(decoded, vectors)


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_truncate_none_on_a_too_long_text_is_a_422_the_client_raises(co, co_v1, card, version):
    with pytest.raises(UnprocessableEntityError) as raised:
        if version == "v2":
            co.embed(model=card.id, texts=[TEXTS[0], LONG_TEXT], input_type="search_document", truncate="NONE")
        else:
            co_v1.embed(model=card.id, texts=[TEXTS[0], LONG_TEXT], truncate="NONE")
    assert raised.value.status_code == 422
    assert message(raised).startswith(
        "texts[1] is longer than the model's max_length of 256 tokens: shorten it, or send truncate END"
    )


def test_v2_refusals_reach_the_client_as_400_saying_what_to_fix(co, card):
    base = {"model": card.id, "texts": TEXTS[:1], "input_type": "search_document"}
    cases = [
        ({"embedding_types": ["float16"]}, "unknown embedding type 'float16': `embedding_types` takes float, int8"),
        ({"input_type": "image"}, "input_type 'image' is for `images` (data: URLs), not texts"),
        ({"input_type": "search"}, "unknown input_type 'search': send one of search_query, search_document"),
        ({"truncate": "START"}, "truncate START is not supported: shoal cuts long texts at the end"),
        ({"truncate": "LEFT"}, "unknown truncate 'LEFT': send NONE, START or END"),
        ({"max_tokens": 64}, "max_tokens 64 is below model sentence-transformers/all-MiniLM-L6-v2's max_length of 256"),
        ({"output_dimension": 1024}, "dimensions 1024 is larger than the model's 384"),
        ({"images": ["data:image/png;base64,AAAA"]}, "send either `texts` or `images`, not both"),
        (
            {"texts": None, "inputs": [{"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "inputs[0].content[0].image_url.url is a data: URL of type 'text/plain', not an image",
        ),
        ({"texts": []}, "`texts` is empty: send at least one string"),
    ]
    for change, fragment in cases:
        kwargs = {k: v for k, v in {**base, **change}.items() if v is not None}
        with pytest.raises(BadRequestError) as raised:
            co.embed(**kwargs)
        assert raised.value.status_code == 400
        assert fragment in message(raised), change


def test_v2_unknown_model_is_a_404_the_client_raises(co):
    with pytest.raises(NotFoundError) as raised:
        co.embed(model="no/such-model", texts=TEXTS[:1], input_type="search_document")
    assert raised.value.status_code == 404


def test_malformed_bodies_are_400_naming_the_field(base_url, card):
    cases = [
        ("/v2/embed", {"texts": ["a"]}, "missing required field `model`"),
        ("/v2/embed", {"model": card.id}, "nothing to embed: send `texts` (strings) or `inputs`"),
        (
            "/v2/embed",
            {"model": card.id, "texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "b"}]}]},
            "send either `texts` or `inputs`, not both",
        ),
        ("/v2/embed", {"model": card.id, "inputs": []}, "`inputs` is empty"),
        ("/v2/embed", {"model": card.id, "inputs": [{"content": []}]}, "inputs[0] has no content"),
        ("/v2/embed", {"model": card.id, "texts": ["a"], "embedding_types": []}, "`embedding_types` is empty"),
        ("/v2/embed", {"model": card.id, "texts": ["a"], "output_dimension": 0}, "at `$.output_dimension`"),
        ("/v2/embed", {"model": card.id, "texts": ["a"], "dimensions": 8}, "unknown field `dimensions`"),
        ("/v1/embed", {"texts": ["a"]}, "no `model`: name the embedding model"),
        ("/v1/embed", {"model": card.id, "texts": []}, "`texts` is empty"),
        ("/v1/embed", {"model": card.id, "texts": ["a"], "output_dimension": 8}, "unknown field `output_dimension`"),
    ]
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for path, body, fragment in cases:
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert fragment in r.json()["error"]["message"], (path, body)
