"""Bad requests get the right 4xx/503, the one error body shape, and a message that names the
problem; and the server still serves a good request afterwards.

    {"error": {"code": "...", "message": "...", "details": {...}}}
"""

from __future__ import annotations

import json

import msgspec
import openai
import pytest

from shoal.config import EngineSettings

GOOD_TEXT = "The server still answers."
JSON = "application/json"
MSGPACK = "application/msgpack"


def encode_body(card, texts, **options) -> dict:
    return {"model": card.id, "items": [{"id": i, "text": t} for i, t in enumerate(texts)], "options": options}


def assert_error(response, status: int, code: str, *named: str, media: str = JSON) -> dict:
    """The status, the error body's format, shape and code, and that the message names each of `named`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(media)
    error = (msgspec.msgpack.decode(response.content) if media == MSGPACK else response.json())["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == code
    for name in named:
        assert name in error["message"]
    return error


def assert_still_serves(client, card) -> None:
    response = client.post("/v1/encode", json=encode_body(card, [GOOD_TEXT]))
    assert response.status_code == 200, response.text
    assert len(response.json()["items"][0]["dense"]) == card.dimensions


# --- body decoding ------------------------------------------------------------------------------


def test_empty_items_is_400_naming_items(client, card):
    response = client.post("/v1/encode", json={"model": card.id, "items": []})

    assert_error(response, 400, "invalid_request", "$.items")
    assert_still_serves(client, card)


def test_non_string_text_is_400_naming_its_path(client, card):
    response = client.post("/v1/encode", json={"model": card.id, "items": [{"text": 5}]})

    assert_error(response, 400, "invalid_request", "$.items[0].text", "str")
    assert_still_serves(client, card)


@pytest.mark.parametrize("route", ["/v1/encode", "/v1/embeddings"])
def test_unknown_model_is_404_naming_the_id(client, card, route):
    body = (
        {"model": "acme/no-such-model", "items": [{"text": "hi"}]}
        if route == "/v1/encode"
        else {"model": "acme/no-such-model", "input": ["hi"]}
    )
    response = client.post(route, json=body)

    error = assert_error(response, 404, "unknown_model", "'acme/no-such-model'", "/v1/models")
    assert error["details"]["model"] == "acme/no-such-model"
    assert card.id not in error["message"]  # the catalog is not dumped into every 404
    assert_still_serves(client, card)


def test_unknown_model_404_suggests_a_close_id_and_echoes_at_most_200_characters_of_it(client, card):
    typo = client.post("/v1/encode", json={"model": card.id.replace("MiniLM", "MiniLm"), "items": [{"text": "hi"}]})
    huge = client.post("/v1/encode", json={"model": "m" * 100_000, "items": [{"text": "hi"}]})

    error = assert_error(typo, 404, "unknown_model", "did you mean", card.id)
    assert error["details"]["suggestions"][0] == card.id
    error = assert_error(huge, 404, "unknown_model")
    assert len(error["message"]) < 400 and len(error["details"]["model"]) <= 201


def test_unknown_option_is_400_naming_the_field(client, card):
    response = client.post("/v1/encode", json=encode_body(card, ["hi"], pooling="cls"))

    assert_error(response, 400, "invalid_request", "pooling", "$.options")
    assert_still_serves(client, card)


def test_malformed_json_is_400(client, card):
    response = client.post("/v1/encode", content=b'{"model": "x", "items": [', headers={"content-type": JSON})

    assert_error(response, 400, "invalid_request", "malformed JSON")
    assert_still_serves(client, card)


def test_malformed_msgpack_is_400(client, card):
    # 0xc1 is the one byte msgpack never uses; the rest is a valid prefix cut short.
    body = msgspec.msgpack.encode(encode_body(card, ["hi"]))[:-3] + b"\xc1"
    response = client.post("/v1/encode", content=body, headers={"content-type": MSGPACK})

    # Errors answer in the request's format unless Accept asks for another.
    assert_error(response, 400, "invalid_request", "malformed msgpack", media=MSGPACK)
    assert_still_serves(client, card)


def test_text_plain_content_type_is_415_naming_the_type(client, card):
    body = json.dumps(encode_body(card, ["hi"])).encode()
    response = client.post("/v1/encode", content=body, headers={"content-type": "text/plain"})

    assert_error(response, 415, "unsupported_media_type", "text/plain")
    assert_still_serves(client, card)


# --- limits -------------------------------------------------------------------------------------


def oversized_body(card, limit: int) -> bytes:
    body = json.dumps(encode_body(card, ["a" * (limit + 1024)])).encode()
    assert len(body) > limit
    return body


def test_body_over_limit_with_content_length_is_413(client, card, server_settings):
    limit = server_settings.max_body_bytes
    response = client.post("/v1/encode", content=oversized_body(card, limit), headers={"content-type": JSON})

    error = assert_error(response, 413, "payload_too_large", str(limit))
    assert error["details"] == {"limit_bytes": limit}
    assert_still_serves(client, card)


def test_streamed_body_over_limit_is_413(client, card, server_settings):
    limit = server_settings.max_body_bytes
    body = oversized_body(card, limit)

    def chunks():  # a generator: httpx sends it chunked, with no Content-Length to check up front
        for start in range(0, len(body), 16 * 1024):
            yield body[start : start + 16 * 1024]

    response = client.post("/v1/encode", content=chunks(), headers={"content-type": JSON})

    assert "content-length" not in response.request.headers
    error = assert_error(response, 413, "payload_too_large", str(limit))
    assert error["details"] == {"limit_bytes": limit}
    assert_still_serves(client, card)


def test_too_many_items_is_400_naming_count_and_limit(client, card, server_settings):
    limit = server_settings.max_items_per_request
    response = client.post("/v1/encode", json=encode_body(card, ["hi"] * (limit + 1)))

    error = assert_error(response, 400, "invalid_request", f"{limit + 1} items", f"limit is {limit}")
    assert error["details"] == {"items": limit + 1, "max_items": limit}
    assert_still_serves(client, card)


def test_text_over_max_length_is_422_without_truncation_and_200_with_it(client, card):
    long_text = " ".join(f"word{i}" for i in range(400))
    refused = client.post("/v1/encode", json=encode_body(card, ["short", long_text], truncate=False))
    truncated = client.post("/v1/encode", json=encode_body(card, ["short", long_text]))

    error = assert_error(refused, 422, "input_too_long", "items[1]", str(card.max_length))
    assert error["details"] == {"index": 1, "max_length": card.max_length}
    assert truncated.status_code == 200, truncated.text
    assert len(truncated.json()["items"]) == 2


# --- options the model cannot honour ------------------------------------------------------------


def test_dimensions_above_model_size_is_400_naming_model_and_option(client, card):
    response = client.post("/v1/encode", json=encode_body(card, ["hi"], dimensions=card.dimensions + 1))

    error = assert_error(response, 400, "invalid_request", card.id, "dimensions", str(card.dimensions))
    assert error["details"]["option"] == "dimensions"
    assert_still_serves(client, card)


def test_unknown_prompt_name_is_400_naming_the_prompt(client, card):
    response = client.post("/v1/encode", json=encode_body(card, ["hi"], prompt_name="query"))

    error = assert_error(response, 400, "invalid_request", card.id, "'query'")
    assert error["details"]["option"] == "prompt_name"
    assert_still_serves(client, card)


def test_openai_input_mixing_texts_and_bare_numbers_is_400_naming_the_input(openai_client, client, card):
    # Token ids are decoded (tests/test_token_ids.py); a bare number among texts is neither form.
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.embeddings.create(model=card.id, input=["a text", 7592])  # type: ignore[list-item]

    assert caught.value.status_code == 400
    assert caught.value.body["code"] == "invalid_request"
    assert "input[1]" in caught.value.body["message"] and "number among other inputs" in caught.value.body["message"]
    assert caught.value.body["details"] == {"path": "$.input[1]"}
    assert_still_serves(client, card)


# --- routing ------------------------------------------------------------------------------------


def test_unknown_route_is_404_json_naming_the_path(client, card):
    response = client.post("/v1/no-such-route", json={"model": card.id})

    assert_error(response, 404, "not_found", "/v1/no-such-route")
    assert_still_serves(client, card)


def test_wrong_method_is_405_json_naming_the_method(client, card):
    response = client.get("/v1/encode")

    assert_error(response, 405, "method_not_allowed", "GET /v1/encode")
    assert_still_serves(client, card)


def test_wrong_method_405_says_which_methods_are_allowed(client):
    # RFC 9110 §15.5.6: a 405 response MUST carry an Allow header.
    response = client.get("/v1/encode")

    assert response.status_code == 405
    assert response.headers.get("allow") == "POST"


# --- backpressure -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_queue_url(serve) -> str:
    """A second server whose engine admits at most 4 waiting items."""
    return serve(engine=EngineSettings(max_queue_items=4))


def test_request_larger_than_the_whole_queue_is_400_not_a_retryable_503(small_queue_url, card):
    import httpx

    with httpx.Client(base_url=small_queue_url, timeout=60.0) as http:
        refused = http.post("/v1/encode", json=encode_body(card, [f"text {i}" for i in range(5)]))
        accepted = http.post("/v1/encode", json=encode_body(card, ["one", "two"]))

    error = assert_error(refused, 400, "invalid_request", "5 items", "(4)")
    assert error["details"] == {"items": 5, "max_queue_items": 4}
    assert "retry-after" not in refused.headers
    assert accepted.status_code == 200, accepted.text


def test_a_full_queue_answers_503_with_retry_after_and_loses_no_admitted_work(small_queue_url, card, reference_model):
    """16 requests of 3 items arrive at once; the queue holds 4 items, so while one request waits
    for the device, the others are refused with 503 + Retry-After. Every admitted one is answered
    with its own correct vectors."""
    import asyncio

    import httpx
    import numpy as np

    texts = [[f"request {r} sentence {i} about shoals of fish" for i in range(3)] for r in range(16)]

    async def burst():
        async with httpx.AsyncClient(base_url=small_queue_url, timeout=60.0) as http:
            return await asyncio.gather(*(http.post("/v1/encode", json=encode_body(card, t)) for t in texts))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 503]
    answered = [(t, r) for t, r in zip(texts, responses) if r.status_code == 200]
    assert len(refused) + len(answered) == len(texts), [r.status_code for r in responses]
    assert refused, "a queue of 4 items took 16 concurrent 3-item requests without refusing any"
    for response in refused:
        assert_error(response, 503, "overloaded", "limit 4")
        assert int(response.headers["retry-after"]) >= 1
    assert answered
    for request_texts, response in answered:
        expected = reference_model.encode(request_texts)
        for item, vector in zip(response.json()["items"], expected):
            got = np.asarray(item["dense"])
            assert float(got @ vector / np.linalg.norm(got) / np.linalg.norm(vector)) >= 0.99999


# --- inputs that used to be 500s ----------------------------------------------------------------


@pytest.mark.parametrize("depth", [50, 5000])
def test_deeply_nested_input_is_400_not_a_recursion_error(client, card, depth):
    nested = "[" * depth + "]" * depth
    openai_body = f'{{"model": "{card.id}", "input": {nested}}}'.encode()
    encode_raw = f'{{"model": "{card.id}", "items": [{{"text": "a", "id": {nested}}}]}}'.encode()

    for route, raw in (("/v1/embeddings", openai_body), ("/v1/encode", encode_raw)):
        response = client.post(route, content=raw, headers={"content-type": JSON})
        assert_error(response, 400, "invalid_request", "$.")
    deep: list = []
    for _ in range(min(depth, 500)):
        deep = [deep]
    nested_msgpack = msgspec.msgpack.encode({"model": card.id, "input": deep})
    response = client.post("/v1/embeddings", content=nested_msgpack, headers={"content-type": MSGPACK})
    assert_error(response, 400, "invalid_request", media=MSGPACK)
    assert_still_serves(client, card)


@pytest.mark.parametrize("item_id", [2**63, -(2**63) - 1, 10**30])
def test_an_integer_id_outside_int64_is_400_naming_its_path_before_any_compute(client, card, item_id):
    raw = f'{{"model": "{card.id}", "items": [{{"id": {item_id}, "text": "a"}}]}}'.encode()

    response = client.post("/v1/encode", content=raw, headers={"content-type": JSON, "accept": MSGPACK})

    assert_error(response, 400, "invalid_request", "$.items[0].id", media=MSGPACK)
    assert_still_serves(client, card)


def test_the_largest_int64_ids_round_trip_in_msgpack(client, card):
    ids = [2**63 - 1, -(2**63)]
    body = msgspec.msgpack.encode({"model": card.id, "items": [{"id": i, "text": "a"} for i in ids]})

    response = client.post("/v1/encode", content=body, headers={"content-type": MSGPACK, "accept": MSGPACK})

    assert response.status_code == 200
    assert [item["id"] for item in msgspec.msgpack.decode(response.content)["items"]] == ids


@pytest.mark.parametrize("route", ["/v1/encode", "/v1/embeddings"])
@pytest.mark.parametrize("escape", ["\\ud800", "\\udc00", "\\ud800\\u0041"])
def test_a_lone_surrogate_is_400_saying_what_is_wrong_and_where(client, card, route, escape):
    text = f'"ok {escape} broken"'
    raw = (
        f'{{"model": "{card.id}", "items": [{{"text": "fine"}}, {{"text": {text}}}]}}'
        if route == "/v1/encode"
        else f'{{"model": "{card.id}", "input": ["fine", {text}]}}'
    ).encode()

    response = client.post(route, content=raw, headers={"content-type": JSON})

    error = assert_error(response, 400, "invalid_request", "surrogate", "byte", "valid Unicode")
    start = raw.index(escape.encode()[:6])  # the byte msgspec names is within the bad escape (or just after)
    assert start <= error["details"]["byte"] <= start + 14, (start, error["details"])
    paired = client.post(
        "/v1/encode",
        content=f'{{"model": "{card.id}", "items": [{{"text": "\\ud83d\\udc1f"}}]}}'.encode(),
        headers={"content-type": JSON},
    )
    assert paired.status_code == 200  # a surrogate pair is one character (a fish), and fine


def test_404_and_405_answer_in_msgpack_when_the_client_accepts_only_msgpack(client):
    missing = client.post("/v1/nowhere", headers={"accept": MSGPACK})
    wrong = client.get("/v1/encode", headers={"accept": MSGPACK})

    assert_error(missing, 404, "not_found", "/v1/nowhere", media=MSGPACK)
    assert_error(wrong, 405, "method_not_allowed", media=MSGPACK)
    assert wrong.headers["allow"] == "POST"
