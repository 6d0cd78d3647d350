"""`GET /openapi.json` describes every route the app serves, is a valid OpenAPI 3.1 document, and its
schemas (generated from the wire types) accept the bodies real clients send and the server's own
responses; `/docs` renders it."""

from __future__ import annotations

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate

from conftest import MODEL_ID


@pytest.fixture(scope="module")
def document(base_url) -> dict:
    return httpx.get(f"{base_url}/openapi.json").json()


def test_the_document_is_valid_openapi_and_names_every_route_of_the_app(document):
    from shoal.api import create_app
    from shoal.config import Settings
    from standin import StandIn

    validate(document)
    app = create_app(Settings(), StandIn())
    served = {(r.path.replace(":path}", "}"), m.lower()) for r in app.routes for m in r.methods if m != "HEAD"}
    described = {(path, method) for path, ops in document["paths"].items() for method in ops}
    assert served == described


def body_schema(document: dict, path: str, method: str, part: str) -> dict:
    op = document["paths"][path][method]
    media = op["requestBody"]["content"] if part == "request" else op["responses"]["200"]["content"]
    return {**media["application/json"]["schema"], "components": document["components"]}


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/encode", {"model": MODEL_ID, "items": [{"id": 1, "text": "hi"}], "options": {"dimensions": 64}}),
        ("/v1/embeddings", {"model": MODEL_ID, "input": ["hi", "there"], "encoding_format": "float"}),
        ("/v1/score", {"model": MODEL_ID, "query": "q", "items": [{"text": "a"}, {"text": "b"}]}),
        ("/embed", {"inputs": ["hi"], "normalize": False}),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", "c"]}}),
    ],
)
def test_the_schemas_accept_what_clients_send_and_what_the_server_answers(base_url, document, path, body):
    jsonschema.validate(body, body_schema(document, path, "post", "request"))
    response = httpx.post(f"{base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    jsonschema.validate(response.json(), body_schema(document, path, "post", "response"))


def test_the_schemas_refuse_a_body_the_server_refuses(base_url, document):
    bad = {"model": MODEL_ID, "items": [], "unknown": 1}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, body_schema(document, "/v1/encode", "post", "request"))
    assert httpx.post(f"{base_url}/v1/encode", json=bad).status_code == 400


def test_docs_renders_the_document(base_url):
    page = httpx.get(f"{base_url}/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in page.text and "SwaggerUIBundle" in page.text
