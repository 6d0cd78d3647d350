"""`create_app(settings, engine)`: the HTTP surface over an engine.

Body limits, format negotiation, error mapping, metrics and the timing header are written once, in
`endpoint`; handlers in `routes` only translate wire types to engine calls.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .. import wire
from ..config import Settings
from ..engine import Engine
from ..errors import PayloadTooLarge, ShoalError
from . import routes
from .errors import error_response, http_error

log = logging.getLogger("shoal.api")

Handler = Callable[[routes.Context], Awaitable[Any]]


def create_app(settings: Settings, engine: Engine, *, preload: tuple[str, ...] = ()) -> Starlette:
    """The ASGI app; its lifespan starts the engine and loads `preload` models before serving."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await engine.start()
        await engine.warm(list(preload))
        try:
            yield
        finally:
            await engine.stop()

    server = settings.server

    def endpoint(name: str, handler: Handler, *, reads_body: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            started = time.perf_counter()
            fmt_out = wire.Format.JSON
            ctx = None
            try:
                fmt_in = wire.format_of_content_type(request.headers.get("content-type")) if reads_body else wire.Format.JSON
                fmt_out = wire.format_of_accept(request.headers.get("accept"), fmt_in)
                body = await _read_body(request, server.max_body_bytes) if reads_body else b""
                ctx = routes.Context(request, engine, body, fmt_in, server.max_items_per_request)
                result = await handler(ctx)
                if isinstance(result, wire.EncodeResponse):
                    result.timings.total_ms = round((time.perf_counter() - started) * 1000.0, 3)
                response = Response(wire.encode(result, fmt_out), media_type=fmt_out.value)
            except ShoalError as exc:
                response = error_response(exc, fmt_out)
            except ClientDisconnect:
                response = Response(status_code=499)
            except Exception:
                log.exception("unhandled error in %s", name)
                response = error_response(ShoalError("internal error; the server log has the traceback"), fmt_out)
            elapsed = time.perf_counter() - started
            model = _model_label(engine, ctx.model if ctx else None)
            engine.metrics.requests.labels(name, model, str(response.status_code)).inc()
            engine.metrics.request_seconds.labels(name, model).observe(elapsed)
            response.headers["x-shoal-time-ms"] = f"{elapsed * 1000.0:.3f}"
            return response

        return run

    async def healthz(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=wire.JSON)

    async def readyz(request: Request) -> Response:
        if engine.ready:
            return Response(b'{"status":"ready"}', media_type=wire.JSON)
        return Response(b'{"status":"not ready"}', status_code=503, media_type=wire.JSON)

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.exposition(), media_type=engine.metrics.content_type)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return http_error(code, message, exc.status_code, headers=exc.headers)

    app = Starlette(
        routes=[
            Route("/v1/encode", endpoint("encode", routes.encode), methods=["POST"]),
            Route("/v1/embeddings", endpoint("embeddings", routes.embeddings), methods=["POST"]),
            Route("/v1/models", endpoint("models", routes.models, reads_body=False), methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: on_http_error},
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.settings = settings
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body of {size} bytes exceeds the limit of {limit} bytes; split it into smaller requests",
        details={"limit_bytes": limit},
    )


def _model_label(engine: Engine, model: str | None) -> str:
    # Only catalog ids become label values, so clients cannot grow the metric's cardinality.
    return model if model is not None and model in engine.catalog else "-"

