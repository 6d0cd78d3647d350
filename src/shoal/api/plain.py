"""Routes served as they are, outside `app.endpoint` (no auth, no body, no request metrics): the
probes (`/healthz`, TEI's `/health` and `GET /`, `/readyz`), `/metrics`, and the API's own
description (`/openapi.json`, rendered at `/docs` by Swagger UI, whose files come from the
swagger-ui-bundle-v2 package and are served under `/docs/assets/`: the page loads nothing from
another host). Each reads what it needs from `app.state`.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from .. import wire
from ..service import Service
from . import openapi  # openapi imports the table, which imports this module: used at call time only
from .errors import http_error

# The Swagger UI files /docs loads, and their media types: the only names /docs/assets/ serves.
DOCS_ASSETS = {
    "swagger-ui.css": "text/css; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
# An asset asked for with the page's `?v=` (the installed Swagger UI's folder name) never changes;
# without it, a client revalidates (ETag).
_IMMUTABLE = "public, max-age=31536000, immutable"
_REVALIDATE = "no-cache"


async def healthz(request: Request) -> Response:
    """The process is up (it answers); says nothing of the models."""
    return Response(b'{"status":"ok"}', media_type=wire.JSON)


async def readyz(request: Request) -> Response:
    """200 once the service serves and its preloaded models are warm; else 503, saying which are
    still loading (`loading`) or failed to load (`failed`: id -> why)."""
    service: Service = request.app.state.service
    preloading = getattr(request.app.state, "preloading", None)
    loading = list(preloading.loading) if preloading is not None and not preloading.done else []
    failed = dict(preloading.failed) if preloading is not None else {}
    if service.ready and preloading is not None and preloading.done and not failed:
        return Response(b'{"status":"ready"}', media_type=wire.JSON)
    body: dict[str, object] = {"status": "preload failed" if failed else "loading" if loading else "not ready"}
    if loading or (preloading is not None and not preloading.done):
        body["loading"] = loading
    if failed:
        body["failed"] = failed
    return Response(msgspec.json.encode(body), status_code=503, media_type=wire.JSON)


async def metrics(request: Request) -> Response:
    service: Service = request.app.state.service
    return Response(service.metrics.exposition(), media_type=service.metrics.content_type)


async def openapi_json(request: Request) -> Response:
    """The document `create_app` encoded once from the route table (`api/openapi.py`), its examples
    naming the models this server serves now (its default model, else loaded ones). The document
    answers without a token, so a server with tokens names built-in cards instead: a token's
    allow-list hides the other models from it, and this must not show them."""
    document: bytes = request.app.state.openapi
    service: Service = request.app.state.service
    server = request.app.state.settings.server
    has_tokens = server.auth_tokens_file is not None or bool(server.auth_tokens or server.admin_tokens)
    statuses = [] if has_tokens else service.models()
    models = openapi.example_models(statuses, None if has_tokens else server.default_model)
    return Response(openapi.with_models(document, models), media_type=wire.JSON)


async def docs(request: Request) -> Response:
    """Swagger UI over `/openapi.json`; its URLs are relative, so it works behind a path prefix too."""
    folder = _swagger_ui()
    if folder is None:
        return Response(_NO_UI_PAGE, media_type="text/html; charset=utf-8", headers={"cache-control": _REVALIDATE})
    page = _DOCS_PAGE.replace(b"{version}", folder.name.encode())
    return Response(page, media_type="text/html; charset=utf-8", headers={"cache-control": _REVALIDATE})


async def docs_asset(request: Request) -> Response:
    """One of `DOCS_ASSETS` from the installed Swagger UI; any other name is a 404, so no path
    outside that list can be read."""
    name: str = request.path_params["name"]
    folder = _swagger_ui()
    if name not in DOCS_ASSETS or folder is None:
        message = f"GET {request.url.path}: no such file; /docs/assets/ serves {', '.join(DOCS_ASSETS)}"
        return http_error("not_found", message, 404)
    path = folder / name
    try:
        stat = os.stat(path)
    except FileNotFoundError:  # an install that lost the file: say which
        return http_error("not_found", f"GET {request.url.path}: {path} is missing from this install", 404)
    versioned = request.query_params.get("v") == folder.name
    headers = {"cache-control": _IMMUTABLE if versioned else _REVALIDATE, "x-content-type-options": "nosniff"}
    response = FileResponse(path, media_type=DOCS_ASSETS[name], headers=headers, stat_result=stat)
    if request.headers.get("if-none-match") == response.headers["etag"]:
        return Response(status_code=304, headers={**headers, "etag": response.headers["etag"]})
    return response


def _swagger_ui() -> Path | None:
    """The installed Swagger UI's folder (swagger-ui-bundle-v2's `swagger-ui-<version>`), or None."""
    try:
        from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]
    except ImportError:
        return None
    return Path(swagger_ui_path)


# `{version}`: the Swagger UI folder's name, so a new release is a new URL for the browser's cache.
# validatorUrl null: Swagger UI would otherwise send the document to validator.swagger.io.
_DOCS_PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shoal API</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" type="image/png" href="docs/assets/favicon-32x32.png?v={version}">
<link rel="stylesheet" href="docs/assets/swagger-ui.css?v={version}"></head>
<body><div id="ui"></div>
<script src="docs/assets/swagger-ui-bundle.js?v={version}"></script>
<script>SwaggerUIBundle({url: "openapi.json", dom_id: "#ui", validatorUrl: null, deepLinking: true,
  displayRequestDuration: true});</script>
<noscript>The description is at <a href="openapi.json">/openapi.json</a>.</noscript>
</body></html>
"""

_NO_UI_PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shoal API</title></head>
<body><p>Swagger UI is not installed with this server (the swagger-ui-bundle-v2 package, a dependency
of shoal): the description is at <a href="openapi.json">/openapi.json</a>.</p></body></html>
"""
