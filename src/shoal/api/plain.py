"""Routes served as they are, outside `app.endpoint` (no auth, no body, no request metrics): the
probes (`/healthz`, TEI's `/health` and `GET /`, `/readyz`), `/metrics`, and the API's own
description (`/openapi.json`, rendered at `/docs`). Each reads what it needs from `app.state`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import wire
from ..service import Service


async def healthz(request: Request) -> Response:
    """The process is up (it answers); says nothing of the models."""
    return Response(b'{"status":"ok"}', media_type=wire.JSON)


async def readyz(request: Request) -> Response:
    """200 once the service serves (started, preloaded models warm), else 503."""
    service: Service = request.app.state.service
    if service.ready:
        return Response(b'{"status":"ready"}', media_type=wire.JSON)
    return Response(b'{"status":"not ready"}', status_code=503, media_type=wire.JSON)


async def metrics(request: Request) -> Response:
    service: Service = request.app.state.service
    return Response(service.metrics.exposition(), media_type=service.metrics.content_type)


async def openapi_json(request: Request) -> Response:
    """The document `create_app` encoded once from the route table (`api/openapi.py`)."""
    document: bytes = request.app.state.openapi
    return Response(document, media_type=wire.JSON)


async def docs(request: Request) -> Response:
    return Response(DOCS_HTML, media_type="text/html")


DOCS_HTML = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>shoal API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
<noscript>The description is at <a href="/openapi.json">/openapi.json</a>.</noscript>
</body></html>
"""
