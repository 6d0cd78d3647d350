"""`GET /openapi.json` and `/docs`: the HTTP surface described from the wire types themselves.

Each operation names its request and response types (the msgspec Structs the handlers decode and
encode); `msgspec.json.schema_components` turns them into JSON Schema, so the description cannot
drift from what the server parses. `describe(app)` refuses a route of the app that no operation
describes (tests call it), and `/docs` renders the document with Swagger UI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from .. import __version__, wire
from ..service import Token

ModelEntry = dict[str, Any]  # /v1/models entries: see routes._model_entry (an open object)


@dataclass(frozen=True)
class Operation:
    path: str
    method: str
    summary: str
    request: Any = None  # the body type (a tuple: any one of them); None: no body
    response: Any = None  # the 200 body type (a tuple: any one of them); None: not JSON (or empty)
    media: str = "application/json"
    params: tuple[str, ...] = ()  # path parameters


_TEI_ROOT = (wire.tei.EmbedRequest, wire.tei.SimilarityRequest, wire.tei.RerankRequest)

OPERATIONS = (
    Operation("/v1/encode", "post", "Encode texts: dense, sparse and multi-vector outputs", wire.EncodeRequest,
              wire.EncodeResponse),
    Operation("/v1/score", "post", "Score documents against a query (rerank)", wire.ScoreRequest, wire.ScoreResponse),
    Operation("/v1/extract", "post", "Extract entities or zero-shot labels", wire.ExtractRequest,
              wire.ExtractResponse),
    Operation("/v1/embeddings", "post", "OpenAI-compatible embeddings", wire.EmbeddingsRequest,
              wire.EmbeddingsResponse),
    Operation("/v1/rerank", "post", "Cohere v1 (and Jina) rerank", wire.cohere.RerankRequest,
              wire.cohere.RerankResponse),
    Operation("/v2/rerank", "post", "Cohere v2 rerank", wire.cohere.RerankV2Request, wire.cohere.RerankV2Response),
    Operation("/v1/embed", "post", "Cohere v1 embed", wire.cohere.EmbedRequest,
              (wire.cohere.EmbedFloatsResponse, wire.cohere.EmbedByTypeResponse)),
    Operation("/v2/embed", "post", "Cohere v2 embed", wire.cohere.EmbedV2Request, wire.cohere.EmbedByTypeResponse),
    Operation("/rerank", "post", "TEI rerank", wire.tei.RerankRequest, list[wire.tei.Rank]),
    Operation("/embed", "post", "TEI embed", wire.tei.EmbedRequest, list[list[float]]),
    Operation("/embed_all", "post", "TEI token states (unpooled)", wire.tei.EmbedSparseRequest,
              list[list[list[float]]]),
    Operation("/tokenize", "post", "TEI tokenize", wire.tei.TokenizeRequest, list[list[Token]]),
    Operation("/embed_sparse", "post", "TEI sparse embed", wire.tei.EmbedSparseRequest,
              list[list[wire.tei.SparseValue]]),
    Operation("/similarity", "post", "TEI sentence similarity", wire.tei.SimilarityRequest, list[float]),
    Operation("/", "post", "TEI's root: embed, similarity or rerank, by the body", _TEI_ROOT,
              (list[list[float]], list[float], list[wire.tei.Rank])),
    Operation("/info", "get", "TEI model info", response=dict[str, Any]),
    Operation("/v1/models", "get", "The models this server serves (OpenAI list shape)", response=dict[str, Any]),
    Operation("/v1/models/{model_path}", "get", "One model (ids contain `/`)", response=ModelEntry,
              params=("model_path",)),
    Operation("/v1/models/{model_path}", "post", "Admin: `{id}/load`, `/unload`, `/pin`, `/unpin` (admin scope)",
              response=ModelEntry, params=("model_path",)),
    Operation("/healthz", "get", "Process up"),
    Operation("/health", "get", "Process up (TEI's name)"),
    Operation("/", "get", "Process up (TEI's root)"),
    Operation("/readyz", "get", "Engine ready (503 otherwise)"),
    Operation("/metrics", "get", "Prometheus metrics", media="text/plain"),
    Operation("/openapi.json", "get", "This document", response=dict[str, Any]),
    Operation("/docs", "get", "This document, rendered", media="text/html"),
)


def describe(routes: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document. `routes` ((path, method) the app serves): each must be described."""
    described = {(op.path, op.method) for op in OPERATIONS}
    missing = sorted(set(routes or ()) - described)
    if missing:
        raise RuntimeError(f"routes without an OpenAPI description: {missing}")
    types = [m for op in OPERATIONS for t in (op.request, op.response) if t is not None for m in _members(t)]
    schemas, components = msgspec.json.schema_components(
        [*types, wire.ErrorResponse], schema_hook=_array_schema, ref_template="#/components/schemas/{name}")
    of_type = dict(zip(map(id, types), schemas))
    error_schema = schemas[-1]

    def schema(t: Any) -> dict:
        return {"anyOf": [of_type[id(m)] for m in t]} if isinstance(t, tuple) else of_type[id(t)]

    paths: dict[str, dict] = {}
    for op in OPERATIONS:
        entry: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op)}
        if op.params:
            entry["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                   for p in op.params]
        if op.request is not None:
            body = {"schema": schema(op.request)}
            entry["requestBody"] = {"required": True, "content": {"application/json": body,
                                                                  "application/msgpack": body}}
        ok: dict[str, Any] = {"description": "OK"}
        if op.response is not None:
            ok["content"] = {"application/json": {"schema": schema(op.response)}}
        elif op.media != "application/json":
            ok["content"] = {op.media: {"schema": {"type": "string"}}}
        entry["responses"] = {"200": ok, "default": {
            "description": "An error: {error: {code, message, details}} (docs/api.md#errors)",
            "content": {"application/json": {"schema": error_schema}}}}
        paths.setdefault(op.path, {})[op.method] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "shoal", "version": __version__,
                 "description": "Serve small models: encode, score, extract (docs/api.md)."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _array_schema(t: type) -> dict:
    if t is np.ndarray:  # a vector or matrix: nested lists in JSON, {dtype, shape, data} in msgpack
        return {"description": "an array: nested lists of numbers in JSON; in msgpack a map of dtype, shape and "
                               "raw little-endian bytes (docs/api.md)"}
    raise NotImplementedError(f"no JSON schema for {t!r}")


def _members(t: Any) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _operation_id(op: Operation) -> str:
    name = op.path.strip("/").replace("/", "_").replace("{", "").replace("}", "") or "root"
    return f"{op.method}_{name}"


DOCS_HTML = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>shoal API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
<noscript>The description is at <a href="/openapi.json">/openapi.json</a>.</noscript>
</body></html>
"""
