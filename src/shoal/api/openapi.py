"""The OpenAPI 3.1 document of the HTTP API (`GET /openapi.json`, rendered at `/docs`), described
from the route table (`api/table.py`) and the wire types themselves.

Each operation names its request and response types (the msgspec types the handlers decode and
encode); `msgspec.json.schema_components` turns them into JSON Schema, so the description cannot
drift from what the server parses, and the app and the document read the same table, so no route
goes undescribed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec
import numpy as np

from .. import __version__, wire
from ..wire import JSONObject
from .table import ROUTES, RouteSpec, Schema

# `{name}` or `{name:converter}` in a Starlette path.
_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def describe(routes: Sequence[RouteSpec] = ROUTES) -> JSONObject:
    """The OpenAPI 3.1 document of `routes` (by default, the app's table)."""
    types = [m for route in routes for t in (route.request, route.response) if t is not None for m in _members(t)]
    schemas, components = msgspec.json.schema_components(
        [*types, wire.ErrorResponse], schema_hook=_array_schema, ref_template="#/components/schemas/{name}"
    )
    of_type = dict(zip(map(id, types), schemas))
    error_schema = schemas[-1]

    def schema(t: Schema) -> JSONObject:
        return {"anyOf": [of_type[id(m)] for m in t]} if isinstance(t, tuple) else of_type[id(t)]

    paths: dict[str, dict[str, JSONObject]] = {}
    for route in routes:
        path, method = _PARAM.sub(r"{\1}", route.path), route.method.lower()
        entry: JSONObject = {"summary": route.summary, "operationId": _operation_id(path, method)}
        params = _PARAM.findall(route.path)
        if params:
            entry["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in params
            ]
        if route.request is not None:
            body = {"schema": schema(route.request)}
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": body, "application/msgpack": body},
            }
        ok: JSONObject = {"description": "OK"}
        if route.response is not None:
            ok["content"] = {"application/json": {"schema": schema(route.response)}}
        elif route.media != "application/json":
            ok["content"] = {route.media: {"schema": {"type": "string"}}}
        entry["responses"] = {
            "200": ok,
            "default": {
                "description": "An error: {error: {code, message, details}} (docs/api.md#errors)",
                "content": {"application/json": {"schema": error_schema}},
            },
        }
        paths.setdefault(path, {})[method] = entry
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "shoal",
            "version": __version__,
            "description": "Serve small models: encode, score, extract (docs/api.md).",
        },
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _array_schema(t: type[object]) -> JSONObject:
    if t is np.ndarray:  # a vector or matrix: nested lists in JSON, {dtype, shape, data} in msgpack
        return {
            "description": "an array: nested lists of numbers in JSON; in msgpack a map of dtype, shape and "
            "raw little-endian bytes (docs/api.md)"
        }
    raise NotImplementedError(f"no JSON schema for {t!r}")


def _members(t: Schema) -> tuple[type[object], ...]:
    return t if isinstance(t, tuple) else (t,)


def _operation_id(path: str, method: str) -> str:
    name = path.strip("/").replace("/", "_").replace("{", "").replace("}", "") or "root"
    return f"{method}_{name}"
