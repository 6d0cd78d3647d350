"""Image inputs on the wire: native `/v1/encode`, `/v1/score` and `/v1/extract` items (and a score's
query) carry an `image` (base64 or a data: URL in JSON; also raw bytes in msgpack), Cohere's
`/v2/embed` and `/v1/embed` take `images` and `image_url` input parts. Each translates to
`calls.Item(image=...)` with the file's bytes intact; every malformed image is a 400 naming its
field; over HTTP an image sent to the text-only MiniLM reaches the engine and comes back a 400
naming the item (not a 500), from the real `cohere` client too; and a small random CLIP served over
HTTP embeds an image sent in every encoding as the engine embeds its bytes in process, and labels
it (`/v1/extract`, kind image_labels) as the engine labels them.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import jsonschema
import msgspec
import numpy as np
import pytest
from PIL import Image

import engine_calls
from conftest import MODEL_ID
from shoal import wire
from shoal.calls import EncodeCall, ExtractCall, ExtractedItem, ExtractResult, Item, LabelScore
from shoal.errors import InvalidRequest
from shoal.wire import cohere_embed, native


def png_bytes(color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    """A real PNG file, as a client sends one."""
    pixels = np.zeros((32, 32, 3), dtype=np.uint8)
    pixels[:16] = color
    pixels[16:, :, 2] = np.arange(32, dtype=np.uint8)[None, :] * 8  # some structure, so two files differ
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png_bytes()
B64 = base64.b64encode(PNG).decode("ascii")
DATA_URL = f"data:image/png;base64,{B64}"


def decoded(body: dict, typ: type, fmt: wire.Format = wire.Format.JSON):
    encode = msgspec.msgpack.encode if fmt is wire.Format.MSGPACK else msgspec.json.encode
    return wire.decode(encode(body), fmt, typ)


def encode_items(items: list[dict], fmt: wire.Format = wire.Format.JSON) -> list:
    return list(native.encode_call(decoded({"model": "m", "items": items}, wire.EncodeRequest, fmt)).items)


def extract_items(items: list[dict], fmt: wire.Format = wire.Format.JSON) -> list:
    body = {"model": "m", "items": items, "labels": ["cat"]}
    return list(native.extract_call(decoded(body, wire.ExtractRequest, fmt)).items)


def refusal(run) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        run()
    return raised.value


# --- native: translation ---------------------------------------------------------------------------


def test_encode_items_carry_the_image_file_bytes_from_base64_and_data_urls_in_json_texts_stay_strings():
    wrapped = "\n".join(B64[i : i + 76] for i in range(0, len(B64), 76))  # MIME line breaks
    unpadded = base64.urlsafe_b64encode(PNG).decode().rstrip("=")  # base64url, no padding
    items = encode_items(
        [
            {"text": "a cat", "id": "t"},
            {"image": B64, "id": 7},
            {"image": DATA_URL},
            {"image": f"DATA:Image/PNG;BASE64,{wrapped}"},
            {"image": unpadded},
        ]
    )
    assert items == ["a cat", Item(image=PNG), Item(image=PNG), Item(image=PNG), Item(image=PNG)]


def test_msgpack_items_take_raw_bytes_as_well_as_base64_and_data_urls():
    items = encode_items([{"image": PNG}, {"image": B64}, {"image": DATA_URL}, {"text": "x"}], wire.Format.MSGPACK)
    assert items == [Item(image=PNG), Item(image=PNG), Item(image=PNG), "x"]


def test_score_query_and_items_may_be_images_and_item_ids_are_kept():
    other = png_bytes((10, 200, 10))
    body = {
        "model": "m",
        "query": {"image": DATA_URL},
        "items": [{"text": "a red square", "id": "a"}, {"image": base64.b64encode(other).decode(), "id": 2}],
    }
    req = decoded(body, wire.ScoreRequest)
    call = native.score_call(req)
    assert call.query == Item(image=PNG)
    assert list(call.documents) == ["a red square", Item(image=other)]
    assert [item.id for item in req.items] == ["a", 2]
    assert native.score_call(decoded({**body, "query": {"text": "q"}}, wire.ScoreRequest)).query == "q"
    assert native.score_call(decoded({**body, "query": "q"}, wire.ScoreRequest)).query == "q"


def test_extract_items_carry_the_image_file_bytes_in_json_and_msgpack_texts_stay_strings():
    as_json = extract_items([{"image": B64, "id": "b"}, {"image": DATA_URL, "id": 2}, {"text": "a cat"}])
    assert as_json == [Item(image=PNG), Item(image=PNG), "a cat"]
    as_msgpack = extract_items([{"image": PNG}, {"image": DATA_URL}, {"image": B64}], wire.Format.MSGPACK)
    assert as_msgpack == [Item(image=PNG)] * 3


def test_an_extract_response_echoes_each_image_items_id_and_index_with_its_labels():
    other = png_bytes((10, 200, 10))
    items = [{"image": B64, "id": "b"}, {"image": base64.b64encode(other).decode(), "id": 2}, {"image": DATA_URL}]
    req = decoded({"model": "m", "items": items, "labels": ["cat", "dog"]}, wire.ExtractRequest)
    labels = [[LabelScore("cat", 0.75), LabelScore("dog", 0.25)], [LabelScore("dog", 0.6), LabelScore("cat", 0.4)]]
    labels.append(labels[0])
    result = ExtractResult(items=[ExtractedItem(labels=each) for each in labels], num_tokens=9)
    body = msgspec.json.decode(msgspec.json.encode(native.extract_response(req, result)))
    assert [(item["id"], item["index"]) for item in body["items"]] == [("b", 0), (2, 1), (None, 2)]
    assert [[(s["label"], s["score"]) for s in item["labels"]] for item in body["items"]] == [
        [("cat", 0.75), ("dog", 0.25)],
        [("dog", 0.6), ("cat", 0.4)],
        [("cat", 0.75), ("dog", 0.25)],
    ]
    assert "entities" not in body["items"][0] and body["usage"] == {"tokens": 9}


def test_a_text_item_the_sdk_encodes_carries_no_image_field():
    body = msgspec.json.decode(msgspec.json.encode(wire.EncodeRequest(model="m", items=[wire.EncodeItem(text="a")])))
    assert body["items"] == [{"text": "a", "id": None}]
    extract = wire.ExtractRequest(model="m", items=[native.ExtractItem(text="a")], labels=["x"])
    assert msgspec.json.decode(msgspec.json.encode(extract))["items"] == [{"text": "a", "id": None}]


# --- native: refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "item, name, fragment",
    [
        ({"text": "a", "image": B64}, "items[1]", "has both a `text` and an `image`: send one of them"),
        ({"id": 3}, "items[1]", "has neither a `text` nor an `image`: send one of them"),
        ({"image": None}, "items[1]", "has neither a `text` nor an `image`"),
        ({"image": "not*base64!"}, "items[1].image", "is not valid base64"),
        ({"image": "abcde"}, "items[1].image", "is not valid base64"),
        ({"image": "https://example.com/cat.png"}, "items[1].image", "the server does not fetch URLs"),
        ({"image": "http://example.com/cat.png"}, "items[1].image", "the server does not fetch URLs"),
        ({"image": "file:///etc/passwd"}, "items[1].image", "the server does not fetch URLs"),
        (
            {"image": f"data:text/plain;base64,{B64}"},
            "items[1].image",
            "a data: URL of type 'text/plain', not an image",
        ),
        ({"image": f"data:;base64,{B64}"}, "items[1].image", "a data: URL of type 'text/plain', not an image"),
        ({"image": "data:image/png,%89PNG"}, "items[1].image", "a data: URL that is not base64"),
        ({"image": "data:image/png;base64"}, "items[1].image", "a data: URL with no ','"),
        ({"image": "data:image/png;base64,@@@@"}, "items[1].image", "is not valid base64"),
        ({"image": 12}, "items[1].image", "is a number, not a string"),
        ({"image": [1, 2]}, "items[1].image", "is an array, not a string"),
    ],
)
@pytest.mark.parametrize("translate", [encode_items, extract_items], ids=["encode", "extract"])
def test_each_malformed_item_is_a_400_naming_it_and_saying_what_to_send(translate, item, name, fragment):
    error = refusal(lambda: translate([{"text": "fine"}, item]))
    assert type(error) is InvalidRequest  # 400 (api/errors.py)
    assert error.message.startswith(f"{name} ") and fragment in error.message, error.message
    assert error.details["path"] == f"$.{name}"
    if name.endswith(".image"):
        assert "send the image file's bytes as base64 or as a data:image/...;base64,... URL" in error.message


def test_a_score_query_and_item_refusals_name_them():
    base = {"model": "m", "query": "q", "items": [{"text": "a"}]}
    query = refusal(
        lambda: native.score_call(decoded({**base, "query": {"image": "https://x/y.png"}}, wire.ScoreRequest))
    )
    assert query.message.startswith("query.image is a URL (https:...), and the server does not fetch URLs")
    both = refusal(
        lambda: native.score_call(decoded({**base, "query": {"text": "q", "image": B64}}, wire.ScoreRequest))
    )
    assert both.message.startswith("query has both a `text` and an `image`")
    item = refusal(lambda: native.score_call(decoded({**base, "items": [{"text": "a"}, {}]}, wire.ScoreRequest)))
    assert item.message.startswith("items[1] has neither a `text` nor an `image`")


# --- Cohere: translation and refusals --------------------------------------------------------------


def cohere_inputs(body: dict, version: str = "v2") -> list:
    typ = cohere_embed.EmbedV2Request if version == "v2" else cohere_embed.EmbedRequest
    return decoded({"model": "m", **body}, typ).inputs_of()


def image_part(url: str = DATA_URL) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cohere_images_with_input_type_image_are_items_of_the_file_bytes(version):
    other = png_bytes((0, 0, 255))
    images = [DATA_URL, f"data:image/jpeg;base64,{base64.b64encode(other).decode()}"]
    inputs = cohere_inputs({"images": images, "input_type": "image", "texts": []}, version)  # texts: [] is unsent
    assert inputs == [Item(image=PNG), Item(image=other)]
    assert cohere_embed.texts_in(inputs) == []
    call = cohere_embed.encode_call(
        decoded({"model": "m", "images": images, "input_type": "image"}, cohere_embed.EmbedRequest), "m", inputs
    )
    assert list(call.items) == inputs and call.is_query is None


def test_cohere_v2_inputs_take_one_image_part_each_beside_text_inputs_in_order():
    inputs = cohere_inputs(
        {
            "input_type": "search_document",
            "inputs": [
                {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"content": [image_part()]},
                {"content": [{"type": "image_url", "image_url": B64}]},  # the URL as a bare string
            ],
        }
    )
    assert inputs == ["a\nb", Item(image=PNG), Item(image=PNG)]
    assert cohere_embed.texts_in(inputs) == ["a\nb"]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"images": [DATA_URL]}, "`images` needs input_type 'image', not None: Cohere embeds `images` with it"),
        (
            {"images": [DATA_URL], "input_type": "search_document"},
            "`images` needs input_type 'image', not 'search_document'",
        ),
        ({"texts": ["a"], "input_type": "image"}, "input_type 'image' is for `images` (data: URLs), not texts"),
        ({"texts": ["a"], "images": [DATA_URL], "input_type": "image"}, "send either `texts` or `images`, not both"),
        ({"inputs": [{"content": [image_part()]}], "images": [DATA_URL]}, "send either `inputs` or `images`, not both"),
        ({"images": [], "input_type": "image"}, "`images` is empty: send at least one image"),
        ({"images": ["https://example.com/cat.png"], "input_type": "image"}, "images[0] is a URL (https:...)"),
        ({"images": [DATA_URL, "data:image/png;base64,%%%"], "input_type": "image"}, "images[1] is not valid base64"),
        ({"images": ["data:application/pdf;base64,AAAA"], "input_type": "image"}, "images[0] is a data: URL of type"),
        (
            {"inputs": [{"content": [{"type": "text", "text": "a cat"}, image_part()]}]},
            "inputs[0] has text and image parts: Cohere fuses them into one embedding, and shoal embeds a text "
            "or an image per input; send them as separate inputs",
        ),
        ({"inputs": [{"content": [image_part(), image_part()]}]}, "inputs[0] has 2 image parts"),
        ({"inputs": [{"content": [image_part("http://x/y.png")]}]}, "inputs[0].content[0].image_url.url is a URL"),
        ({"inputs": [{"content": [{"type": "image_url"}]}]}, 'inputs[0].content[0] must be {"type": "text"'),
        ({"inputs": [{"content": [{"type": "audio"}]}]}, '{"type": "image_url", "image_url": {"url": '),
    ],
)
def test_cohere_image_refusals_are_400s_saying_what_to_fix(body, fragment):
    error = refusal(lambda: cohere_inputs(body))
    assert type(error) is InvalidRequest and fragment in error.message, error.message


# --- OpenAPI --------------------------------------------------------------------------------------


def test_the_openapi_schemas_describe_the_image_fields_and_accept_image_bodies():
    from shoal.api import openapi

    document = openapi.describe()
    schemas = document["components"]["schemas"]
    for name in ("EncodeItem", "ScoreItem", "ScoreQuery", "ExtractItem"):
        image = schemas[name]["properties"]["image"]
        assert image["type"] == "string" and "base64" in image["description"] and "not fetched" in image["description"]
    assert "data:image/" in schemas["ImageUrl"]["properties"]["url"]["description"]
    assert "not fetched" in schemas["EmbedV2Request"]["properties"]["images"]["anyOf"][0]["items"]["description"]

    def request_schema(path: str) -> dict:
        content = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        return {**content["schema"], "components": document["components"]}

    jsonschema.validate({"model": "m", "items": [{"image": DATA_URL}, {"text": "a"}]}, request_schema("/v1/encode"))
    jsonschema.validate({"model": "m", "query": {"image": B64}, "items": [{"image": B64}]}, request_schema("/v1/score"))
    extract = {"model": "m", "items": [{"image": DATA_URL, "id": 1}, {"text": "a"}], "labels": ["cat"]}
    jsonschema.validate(extract, request_schema("/v1/extract"))
    body = {"model": "m", "input_type": "image", "inputs": [{"content": [image_part()]}], "images": [DATA_URL]}
    jsonschema.validate(body, request_schema("/v2/embed"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": "m", "items": [{"image": 5}]}, request_schema("/v1/encode"))


# --- over HTTP, against MiniLM (text only) ---------------------------------------------------------


def test_an_image_item_to_a_text_model_is_a_400_naming_the_item_in_json_and_msgpack(client):
    body = {"model": MODEL_ID, "items": [{"text": "a cat"}, {"image": DATA_URL}]}
    r = client.post("/v1/encode", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"items[1] is an image, and model {MODEL_ID} reads text only"

    raw = {"model": MODEL_ID, "items": [{"image": PNG}]}
    r = client.post("/v1/encode", content=msgspec.msgpack.encode(raw), headers={"content-type": wire.MSGPACK})
    assert r.status_code == 400 and r.headers["content-type"] == wire.MSGPACK
    assert msgspec.msgpack.decode(r.content)["error"]["message"].startswith("items[0] is an image, and model")

    r = client.post("/v1/score", json={"model": MODEL_ID, "query": {"image": B64}, "items": [{"text": "a"}]})
    assert r.status_code == 400 and "is an image, and model" in r.json()["error"]["message"], r.text


def test_malformed_images_over_http_are_400s_naming_the_field(client):
    cases = [
        ("/v1/encode", {"model": MODEL_ID, "items": [{"text": "a"}, {"image": "https://x/cat.png"}]}, "items[1].image"),
        ("/v1/encode", {"model": MODEL_ID, "items": [{"image": "data:text/html;base64,AAAA"}]}, "items[0].image"),
        ("/v1/encode", {"model": MODEL_ID, "items": [{"text": "a", "image": B64}]}, "items[0] has both"),
        ("/v1/score", {"model": MODEL_ID, "query": "q", "items": [{"image": "%%"}]}, "items[0].image is not valid"),
    ]
    for path, body, fragment in cases:
        r = client.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"].startswith(fragment), r.text


def test_the_cohere_client_sends_images_that_reach_the_engine(base_url):
    cohere_sdk = pytest.importorskip("cohere", reason="needs the cohere client")
    from cohere.errors import BadRequestError

    co = cohere_sdk.ClientV2(api_key="x", base_url=base_url, timeout=60)
    with pytest.raises(BadRequestError) as raised:
        co.embed(model=MODEL_ID, images=[DATA_URL], input_type="image", embedding_types=["float"])
    assert raised.value.body["error"]["message"] == f"items[0] is an image, and model {MODEL_ID} reads text only"
    with pytest.raises(BadRequestError) as raised:
        co.embed(model=MODEL_ID, inputs=[{"content": [image_part()]}], input_type="search_document")
    assert "is an image, and model" in raised.value.body["error"]["message"]
    co_v1 = cohere_sdk.Client(api_key="x", base_url=base_url, timeout=60)
    with pytest.raises(BadRequestError) as raised:
        co_v1.embed(model=MODEL_ID, images=[DATA_URL], input_type="image")
    assert "is an image, and model" in raised.value.body["error"]["message"]


# --- over HTTP, against a small random CLIP -------------------------------------------------------

CLIP_ID = "test/clip-wire"
LABELS = ["cat", "dog", "bird"]  # words of the tokenizer's vocabulary, so each label prompt differs


@pytest.fixture(scope="module")
def clip(serve, tmp_path_factory):
    """(base URL, card) of a server of a tiny random-weight CLIP (tests/vision_models.py) that encodes,
    scores and labels images (extract kind image_labels)."""
    pytest.importorskip("transformers")
    from shoal.catalog import parse_card
    from vision_models import tiny_clip

    directory, cards = tmp_path_factory.mktemp("clip-wire"), tmp_path_factory.mktemp("clip-wire-cards")
    fields = tiny_clip(directory, model_id=CLIP_ID, words=LABELS, extract=True).card
    (cards / "clip-wire.yaml").write_text(json.dumps(fields))  # JSON is YAML
    return serve(preload=(CLIP_ID,), cards_dirs=(cards,)), parse_card(fields, "<test>")


OTHER = png_bytes((20, 220, 90))


def in_process(card, call):
    """The call's result from an in-process engine of `card`: what the wire must deliver."""
    from shoal.catalog import Catalog

    (result,) = engine_calls.run(Catalog([card]), call)
    return result


@pytest.fixture(scope="module")
def engine_vectors(clip) -> np.ndarray:
    """`[PNG, OTHER]` embedded in process."""
    vectors = np.stack(in_process(clip[1], EncodeCall(CLIP_ID, [Item(image=PNG), Item(image=OTHER)])).vectors)
    assert not np.allclose(vectors[0], vectors[1], atol=1e-3)  # the two files embed apart: the bytes matter
    return vectors


def test_an_image_sent_in_any_encoding_embeds_as_the_engine_embeds_its_bytes(clip, engine_vectors):
    url = clip[0]
    items = [{"image": B64}, {"image": DATA_URL}, {"image": base64.b64encode(OTHER).decode()}]
    raw = {"model": CLIP_ID, "items": [{"image": PNG}, {"image": OTHER}]}
    with httpx.Client(base_url=url, timeout=60) as http:
        as_json = http.post("/v1/encode", json={"model": CLIP_ID, "items": items})
        as_msgpack = http.post(
            "/v1/encode",
            content=msgspec.msgpack.encode(raw),
            headers={"content-type": wire.MSGPACK, "accept": wire.JSON},
        )
        ranked = http.post("/v1/score", json={"model": CLIP_ID, "query": {"image": DATA_URL}, "items": items})
    for response in (as_json, as_msgpack, ranked):
        assert response.status_code == 200, response.text
    json_vectors = np.asarray([item["dense"] for item in as_json.json()["items"]], dtype=np.float32)
    np.testing.assert_allclose(json_vectors, engine_vectors[[0, 0, 1]], atol=1e-5)
    msgpack_vectors = np.asarray([item["dense"] for item in as_msgpack.json()["items"]], dtype=np.float32)
    np.testing.assert_allclose(msgpack_vectors, engine_vectors, atol=1e-5)
    # The query is the file of items 0 and 1: they rank first.
    assert {item["index"] for item in ranked.json()["items"][:2]} == {0, 1}


def test_the_cohere_client_embeds_images_as_the_engine_does(clip, engine_vectors):
    cohere_sdk = pytest.importorskip("cohere", reason="needs the cohere client")
    co = cohere_sdk.ClientV2(api_key="x", base_url=clip[0], timeout=60)
    images = [DATA_URL, f"data:image/png;base64,{base64.b64encode(OTHER).decode()}"]
    response = co.embed(model=CLIP_ID, images=images, input_type="image", embedding_types=["float"])
    np.testing.assert_allclose(np.asarray(response.embeddings.float_), engine_vectors, atol=1e-5)
    assert response.texts == []


@pytest.fixture(scope="module")
def engine_labels(clip) -> list[list[tuple[str, float]]]:
    """`[PNG, OTHER]` labelled with LABELS in process: (label, probability) per image, best first."""
    result = in_process(clip[1], ExtractCall(CLIP_ID, [Item(image=PNG), Item(image=OTHER)], labels=LABELS))
    labels = [[(s.label, s.score) for s in item.labels or []] for item in result.items]
    assert all(max(p for _, p in row) - min(p for _, p in row) > 1e-4 for row in labels)  # an order to get right
    return labels


def test_image_labels_over_http_come_best_first_summing_to_one_as_the_engine_labels_the_bytes(clip, engine_labels):
    other = base64.b64encode(OTHER).decode()
    items = [{"image": B64, "id": "png"}, {"image": f"data:image/png;base64,{other}", "id": 7}]
    raw = {"model": CLIP_ID, "items": [{"image": PNG}, {"image": OTHER}], "labels": LABELS}
    with httpx.Client(base_url=clip[0], timeout=60) as http:
        as_json = http.post("/v1/extract", json={"model": CLIP_ID, "items": items, "labels": LABELS})
        as_msgpack = http.post(
            "/v1/extract", content=msgspec.msgpack.encode(raw), headers={"content-type": wire.MSGPACK}
        )
        a_text = http.post("/v1/extract", json={"model": CLIP_ID, "items": [{"text": "cat"}], "labels": LABELS})
    assert as_json.status_code == 200, as_json.text
    assert as_msgpack.status_code == 200 and as_msgpack.headers["content-type"] == wire.MSGPACK
    bodies = [as_json.json(), msgspec.msgpack.decode(as_msgpack.content)]
    assert [(item["id"], item["index"]) for item in bodies[0]["items"]] == [("png", 0), (7, 1)]
    for body in bodies:
        got = [[(s["label"], s["score"]) for s in item["labels"]] for item in body["items"]]
        for row in got:
            scores = [score for _, score in row]
            assert sorted(label for label, _ in row) == sorted(LABELS)
            assert scores == sorted(scores, reverse=True)  # best first
            assert abs(sum(scores) - 1.0) < 1e-6  # CLIP: a softmax across the labels
        assert [[label for label, _ in row] for row in got] == [[label for label, _ in row] for row in engine_labels]
        np.testing.assert_allclose(
            [[score for _, score in row] for row in got], [[p for _, p in row] for row in engine_labels], atol=1e-6
        )
    assert a_text.status_code == 400, a_text.text
    assert a_text.json()["error"]["message"].startswith(f"items[0] is a text; model {CLIP_ID} labels images only")
