"""Sparse and multi-vector outputs over real HTTP: the wire shapes in JSON and msgpack."""

from __future__ import annotations

import msgspec
import numpy as np

from shoal.wire import array_from_msgpack

SPLADE = "rasyosef/splade-tiny"
TEXTS = ["the cat sat on the mat", "shoals of fish"]


def body(model: str, **options) -> dict:
    return {"model": model, "items": [{"id": i, "text": t} for i, t in enumerate(TEXTS)], "options": options}


def test_sparse_output_in_json_and_msgpack_carries_the_same_indices_values_and_tokens(client):
    as_json = client.post("/v1/encode", json=body(SPLADE, outputs=["sparse"], sparse_top_k=6, return_tokens=True))
    assert as_json.status_code == 200, as_json.text
    as_msgpack = client.post(
        "/v1/encode",
        content=msgspec.msgpack.encode(body(SPLADE, sparse_top_k=6, return_tokens=True)),
        headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
    )
    assert as_msgpack.status_code == 200
    for j, m in zip(as_json.json()["items"], msgspec.msgpack.decode(as_msgpack.content)["items"]):
        assert "dense" not in j  # the card's first output is sparse; only what is asked comes back
        indices, values = array_from_msgpack(m["sparse"]["indices"]), array_from_msgpack(m["sparse"]["values"])
        assert indices.dtype == np.int32 and values.dtype == np.float32
        assert j["sparse"]["indices"] == indices.tolist() and len(indices) == 6
        np.testing.assert_allclose(j["sparse"]["values"], values, rtol=1e-6)
        assert j["sparse"]["tokens"] == m["sparse"]["tokens"]
    first = as_json.json()["items"][0]["sparse"]["tokens"]
    assert {"cat", "mat"} <= set(first), first  # the heaviest terms of a SPLADE vector are its own words


def test_dense_and_sparse_from_a_model_without_that_output_is_400_naming_what_the_card_allows(client, card):
    response = client.post("/v1/encode", json=body(card.id, outputs=["dense", "multivector"]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert card.id in error["message"] and "multivector" in error["message"]
    assert error["details"] == {"model": card.id, "option": "outputs", "allowed": ["dense"]}


def test_an_unknown_output_kind_is_400_naming_the_field(client, card):
    response = client.post("/v1/encode", json=body(card.id, outputs=["colbert"]))
    assert response.status_code == 400
    assert "$.options.outputs[0]" in response.json()["error"]["message"]
