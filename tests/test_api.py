"""The HTTP API end to end: a real uvicorn server, real clients (httpx, openai), the real MiniLM
weights, and sentence-transformers run in the test as the reference for every vector.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.wire import array_from_msgpack

MSGPACK = "application/msgpack"
DIMS = 384
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on stage.",
    "Stock markets fell sharply after the central bank's announcement.",
    "¿Dónde está la biblioteca?",
    "naïve café résumé — unicode survives the wire",
    "x",
]
# Well over 256 tokens: shoal and the reference must both truncate it the same way.
LONG_TEXT = " ".join(f"word{i}" for i in range(400))


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def encode_body(card, texts, ids=None, **options) -> dict:
    ids = ids if ids is not None else list(range(len(texts)))
    return {"model": card.id, "items": [{"id": i, "text": t} for i, t in zip(ids, texts)], "options": options}


def post_msgpack(client, card, texts, **options) -> dict:
    """POST /v1/encode in msgpack both ways; returns the decoded response object."""
    response = client.post(
        "/v1/encode",
        content=msgspec.msgpack.encode(encode_body(card, texts, **options)),
        headers={"content-type": MSGPACK, "accept": MSGPACK},
    )
    assert response.status_code == 200, response.content
    assert response.headers["content-type"].startswith(MSGPACK)
    return msgspec.msgpack.decode(response.content)


# --- /v1/encode, JSON ---------------------------------------------------------------------------


def test_encode_json_returns_reference_vectors_under_their_ids_in_request_order(client, card, embed_reference):
    texts = SENTENCES + [LONG_TEXT]
    ids = ["first", 7, "third", 0, "fifth", -3, "long"]  # mixed str and int ids keep their type
    response = client.post("/v1/encode", json=encode_body(card, texts, ids=ids))

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == card.id
    assert [item["id"] for item in body["items"]] == ids
    reference = embed_reference(texts)
    for item, expected in zip(body["items"], reference):
        assert len(item["dense"]) == DIMS
        assert cosine(item["dense"], expected) >= 0.99999


def test_encode_usage_counts_tokenizer_tokens_after_truncation(client, card, count_tokens):
    texts = SENTENCES + [LONG_TEXT]
    response = client.post("/v1/encode", json=encode_body(card, texts))

    assert response.status_code == 200, response.text
    assert count_tokens(LONG_TEXT) == card.max_length  # the long text really is truncated
    assert response.json()["usage"]["tokens"] == sum(count_tokens(t) for t in texts)


def test_encode_reports_nonnegative_phase_timings_and_time_header(client, card):
    response = client.post("/v1/encode", json=encode_body(card, SENTENCES[:2]))

    assert response.status_code == 200, response.text
    timings = response.json()["timings"]
    assert set(timings) == {"tokenize_ms", "queue_ms", "inference_ms", "total_ms"}
    assert all(value >= 0 for value in timings.values())
    assert timings["total_ms"] >= timings["inference_ms"]
    assert float(response.headers["x-shoal-time-ms"]) >= timings["total_ms"]


# --- /v1/encode, msgpack ------------------------------------------------------------------------


def test_encode_msgpack_carries_raw_little_endian_float32_equal_to_json(client, card):
    body = post_msgpack(client, card, SENTENCES)
    json_items = client.post("/v1/encode", json=encode_body(card, SENTENCES)).json()["items"]

    assert [item["id"] for item in body["items"]] == list(range(len(SENTENCES)))
    for item, json_item in zip(body["items"], json_items):
        dense = item["dense"]
        assert dense["dtype"] == "float32" and dense["shape"] == [DIMS]
        assert isinstance(dense["data"], bytes) and len(dense["data"]) == DIMS * 4  # raw, not base64
        vector = array_from_msgpack(dense)
        np.testing.assert_array_equal(vector, np.frombuffer(dense["data"], dtype="<f4"))
        np.testing.assert_array_equal(vector, np.asarray(json_item["dense"], dtype=np.float32))


def test_json_request_with_msgpack_accept_gets_a_msgpack_response(client, card, embed_reference):
    response = client.post("/v1/encode", json=encode_body(card, SENTENCES[:2]), headers={"accept": MSGPACK})

    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(MSGPACK)
    body = msgspec.msgpack.decode(response.content)
    for item, expected in zip(body["items"], embed_reference(SENTENCES[:2])):
        assert cosine(array_from_msgpack(item["dense"]), expected) >= 0.99999


# --- /v1/encode options -------------------------------------------------------------------------


def test_dimensions_64_returns_the_renormalised_first_64_reference_values(client, card, embed_reference):
    body = post_msgpack(client, card, SENTENCES, dimensions=64)

    for item, expected in zip(body["items"], embed_reference(SENTENCES)):
        vector = array_from_msgpack(item["dense"])
        assert vector.shape == (64,)
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        assert cosine(vector, expected[:64]) >= 0.99999


def test_normalize_false_returns_the_raw_mean_pooled_vector(client, card, reference_model):
    from sentence_transformers import SentenceTransformer

    # The reference without its Normalize module: transformer + mean pooling only.
    unnormalised = SentenceTransformer(modules=[reference_model[0], reference_model[1]], device="cpu")
    expected = unnormalised.encode(SENTENCES, convert_to_numpy=True)
    body = post_msgpack(client, card, SENTENCES, normalize=False)

    for item, reference in zip(body["items"], expected):
        vector = array_from_msgpack(item["dense"])
        assert abs(np.linalg.norm(vector) - 1.0) > 0.01
        np.testing.assert_allclose(vector, reference, rtol=1e-3, atol=1e-5)


def test_float16_output_is_float16_of_the_reference(client, card, embed_reference):
    body = post_msgpack(client, card, SENTENCES, output_dtype="float16")

    for item, expected in zip(body["items"], embed_reference(SENTENCES)):
        assert item["dense"]["dtype"] == "float16" and item["dense"]["shape"] == [DIMS]
        vector = array_from_msgpack(item["dense"])
        assert vector.dtype == np.float16
        np.testing.assert_allclose(vector.astype(np.float32), expected, atol=1e-3)


def test_int8_output_keeps_cosine_with_the_reference(client, card, embed_reference):
    body = post_msgpack(client, card, SENTENCES, output_dtype="int8")

    for item, expected in zip(body["items"], embed_reference(SENTENCES)):
        assert item["dense"]["dtype"] == "int8" and item["dense"]["shape"] == [DIMS]
        vector = array_from_msgpack(item["dense"])
        assert np.abs(vector.astype(np.int32)).max() == 127  # scaled so the peak component is ±127
        assert cosine(vector, expected) >= 0.999


@pytest.mark.parametrize(("precision", "dtype"), [("binary", "int8"), ("ubinary", "uint8")])
def test_binary_outputs_mean_what_sentence_transformers_quantize_embeddings_means(
    client, card, embed_reference, precision, dtype
):
    from sentence_transformers.quantization import quantize_embeddings

    body = post_msgpack(client, card, SENTENCES, output_dtype=precision)
    json_items = client.post("/v1/encode", json=encode_body(card, SENTENCES, output_dtype=precision)).json()["items"]

    expected = quantize_embeddings(embed_reference(SENTENCES), precision=precision)
    assert expected.dtype == dtype
    for item, json_item, want in zip(body["items"], json_items, expected):
        assert item["dense"]["dtype"] == dtype and item["dense"]["shape"] == [DIMS // 8]
        np.testing.assert_array_equal(array_from_msgpack(item["dense"]), want)
        assert json_item["dense"] == want.tolist()


# --- OpenAI-compatible /v1/embeddings through the official client -------------------------------


def test_openai_client_default_base64_decodes_to_reference_vectors(openai_client, card, embed_reference, count_tokens):
    raw = openai_client.embeddings.with_raw_response.create(model=card.id, input=SENTENCES)
    assert isinstance(raw.http_response.json()["data"][0]["embedding"], str)  # the client asked for base64
    result = raw.parse()

    assert result.model == card.id
    assert [d.index for d in result.data] == list(range(len(SENTENCES)))
    for datum, expected in zip(result.data, embed_reference(SENTENCES)):
        assert len(datum.embedding) == DIMS
        assert cosine(datum.embedding, expected) >= 0.99999
    assert result.usage.prompt_tokens == sum(count_tokens(t) for t in SENTENCES) > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens


def test_openai_client_float_format_returns_reference_vectors(openai_client, card, embed_reference):
    raw = openai_client.embeddings.with_raw_response.create(model=card.id, input=SENTENCES, encoding_format="float")
    assert isinstance(raw.http_response.json()["data"][0]["embedding"], list)
    result = raw.parse()

    for datum, expected in zip(result.data, embed_reference(SENTENCES)):
        assert cosine(datum.embedding, expected) >= 0.99999
    assert result.usage.prompt_tokens > 0


def test_openai_client_dimensions_128_returns_unit_prefix_of_reference(openai_client, card, embed_reference):
    result = openai_client.embeddings.create(model=card.id, input=SENTENCES, dimensions=128)

    for datum, expected in zip(result.data, embed_reference(SENTENCES)):
        assert len(datum.embedding) == 128
        assert np.linalg.norm(datum.embedding) == pytest.approx(1.0, abs=1e-5)
        assert cosine(datum.embedding, expected[:128]) >= 0.99999


def test_openai_client_single_string_input_returns_one_reference_vector(
    openai_client, card, embed_reference, count_tokens
):
    text = SENTENCES[1]
    result = openai_client.embeddings.create(model=card.id, input=text)

    assert len(result.data) == 1 and result.data[0].index == 0
    assert cosine(result.data[0].embedding, embed_reference([text])[0]) >= 0.99999
    assert result.usage.prompt_tokens == count_tokens(text)


# --- concurrency --------------------------------------------------------------------------------

SUBJECTS = [
    "A cat",
    "The committee",
    "My grandmother",
    "A rocket engineer",
    "The river",
    "Every student",
    "A jazz band",
    "The old lighthouse",
]
PREDICATES = ["sleeps through the storm", "votes on the budget", "bakes bread at dawn", "tests a new valve"]


def test_32_concurrent_requests_each_get_their_own_reference_vector(base_url, card, embed_reference):
    texts = [f"{s} {p}." for s in SUBJECTS for p in PREDICATES]
    assert len(set(texts)) == 32

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as http:
            return await asyncio.gather(
                *(
                    http.post("/v1/encode", json=encode_body(card, [text], ids=[f"req-{i}"]))
                    for i, text in enumerate(texts)
                )
            )

    responses = asyncio.run(send_all())

    assert [r.status_code for r in responses] == [200] * 32
    for i, (response, expected) in enumerate(zip(responses, embed_reference(texts))):
        (item,) = response.json()["items"]
        assert item["id"] == f"req-{i}"
        assert cosine(item["dense"], expected) >= 0.99999


# --- models, health, metrics --------------------------------------------------------------------


def test_models_lists_the_minilm_card_as_verified_on_real_weights(client, card):
    response = client.get("/v1/models")

    assert response.status_code == 200
    entries = {entry["id"]: entry for entry in response.json()["data"]}
    minilm = entries[card.id]
    assert minilm["verified"] == "real_weights"
    assert minilm["dimensions"] == DIMS and minilm["max_length"] == 256 and minilm["pooling"] == "mean"
    assert minilm["loaded"] is True  # preloaded by the server fixture


def test_healthz_and_readyz_answer_200(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    readyz = client.get("/readyz")
    assert readyz.status_code == 200 and readyz.json() == {"status": "ready"}


def metric_samples(client) -> dict[tuple, float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_count_an_encode_request_and_its_tokens(client, card):
    request_key = ("shoal_requests_total", (("model", card.id), ("route", "encode"), ("status", "200")))
    tokens_key = ("shoal_tokens_total", (("model", card.id),))
    duration_key = ("shoal_request_duration_seconds_count", (("model", card.id), ("route", "encode")))
    before = metric_samples(client)
    response = client.post("/v1/encode", json=encode_body(card, SENTENCES))
    after = metric_samples(client)

    assert response.status_code == 200
    assert after[request_key] - before.get(request_key, 0.0) == 1
    assert after[tokens_key] - before.get(tokens_key, 0.0) == response.json()["usage"]["tokens"]
    assert after[duration_key] - before.get(duration_key, 0.0) == 1
    assert any(name == "shoal_batch_tokens_bucket" and dict(labels)["model"] == card.id for name, labels in after)
    assert after[("shoal_queue_depth", ())] == 0  # nothing admitted is left waiting
