"""`create_app(settings, service)`: the HTTP surface over any `Service`.

The routes are the rows of the route table (`api/table.py`), which the OpenAPI document is built
from too. Body limits, format negotiation, request ids, cancellation on disconnect, error mapping,
metrics and the timing header are written once, in `endpoint`; handlers in `routes` and `tei` only
translate wire types to calls. The app imports no engine: the in-process Engine and the cluster's
remote service both plug in through `shoal.service.Service`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .. import wire
from ..config import Settings
from ..errors import Cancelled, Overloaded, PayloadTooLarge, ShoalError
from ..service import Service
from . import openapi, routes
from .auth import Auth
from .errors import error_response, http_error
from .table import ROUTES, RouteSpec

log = logging.getLogger("shoal.api")

T = TypeVar("T")
_REQUEST_ID = re.compile(r"[\w.:/-]{1,128}")
# Response headers a browser's script may read on a cross-origin answer (`--allow-origin`).
CORS_EXPOSED = (
    "x-request-id",
    "x-shoal-model",
    "x-shoal-adapter",
    "x-shoal-truncated",
    "x-shoal-time-ms",
    "retry-after",
)
# Responses larger than this are encoded in a worker thread, off the event loop.
_OFF_LOOP_BYTES = 1 << 20


def create_app(
    settings: Settings, service: Service, *, preload: tuple[str, ...] = (), auth: Auth | None = None
) -> Starlette:
    """The ASGI app; its lifespan starts the service, then loads the `preload` models while it
    serves (the port is bound at once; `/readyz` answers 200 once they are warm, and says which
    are loading or failed until then). `auth`: the bearer tokens it accepts (None or none: open,
    as on loopback)."""
    auth = auth or Auth([])

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        preloading = app.state.preloading = Preloading(loading=list(preload))
        task = asyncio.create_task(_preload(service, preloading))
        try:
            yield
        finally:
            task.cancel()
            await service.stop()

    server = settings.server
    metrics = service.metrics

    def endpoint(spec: RouteSpec) -> Callable[[Request], Awaitable[Response]]:
        """`spec.handler` inside what every verb's route does: auth, body, formats, errors, metrics."""
        name, handler, reads_body, admin = spec.name, spec.handler, spec.reads_body, spec.admin
        if handler is None:
            raise TypeError(f"route {spec.name} is plain: it is served as it is, not through `endpoint`")

        async def run(request: Request) -> Response:
            started = time.perf_counter()
            request_id = _request_id(request)
            fmt_out = wire.Format.JSON
            ctx = None
            try:
                fmt_in = wire.Format.JSON
                if reads_body:
                    fmt_in = wire.format_of_content_type(request.headers.get("content-type"))
                fmt_out = wire.format_of_accept(request.headers.get("accept"), fmt_in)
                principal = auth.authenticate(request.headers.get("authorization"))  # before reading a body
                if admin:
                    auth.check_admin(principal)
                body = await _read_body(request, server.max_body_bytes) if reads_body else b""
                ctx = routes.Context(
                    request,
                    service,
                    body,
                    fmt_in,
                    server.max_items_per_request,
                    request_id,
                    preload=preload,
                    principal=principal,
                    default=server.default_model,
                    auto_truncate=server.auto_truncate,
                )
                result = await _unless_disconnected(handler(ctx), request) if reads_body else await handler(ctx)
                timings = getattr(result, "timings", None)
                if isinstance(timings, wire.Timings):
                    timings.total_ms = round((time.perf_counter() - started) * 1000.0, 3)
                if isinstance(result, Response):  # served as it is (a stream of events)
                    response = result
                else:
                    if ctx.result_bytes > _OFF_LOOP_BYTES:
                        content = await asyncio.to_thread(_encode_large, result, fmt_out)
                    else:
                        content = wire.encode(result, fmt_out)
                    response = Response(content, media_type=fmt_out.value)
            except ShoalError as exc:
                response = error_response(exc, fmt_out)
            except ClientDisconnect:
                response = error_response(Cancelled("the client disconnected while sending its body"), fmt_out)
            except Exception:  # a bug in a handler: the client gets a 500 naming its request id, the log the traceback
                log.exception("request %s: unhandled error in %s", request_id, name)
                response = error_response(
                    ShoalError(
                        f"internal error (request id {request_id}); the server log has the traceback",
                        details={"request_id": request_id},
                    ),
                    fmt_out,
                )
            elapsed = time.perf_counter() - started
            model = ctx.model if ctx and ctx.model is not None and service.has_model(ctx.model) else "-"
            metrics.requests.labels(name, model, str(response.status_code)).inc()
            metrics.request_seconds.labels(name, model).observe(elapsed)
            if ctx is not None and ctx.model is not None and response.status_code < 400:
                # Which model (and adapter) answered: a model-less route's client can check it got the one it meant.
                response.headers["x-shoal-model"] = service.model(ctx.model).id if model != "-" else ctx.model
                if ctx.adapter is not None:
                    response.headers["x-shoal-adapter"] = ctx.adapter
                if ctx.truncated:  # every route family says which items were cut, whatever its body's shape
                    response.headers["x-shoal-truncated"] = ",".join(map(str, ctx.truncated))
            response.headers["x-shoal-time-ms"] = f"{elapsed * 1000.0:.3f}"
            response.headers["x-request-id"] = request_id
            return response

        return run

    middleware = []
    if server.allow_origins:
        # Bearer tokens travel in a header, never cookies: no credentials mode is needed.
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(server.allow_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["authorization", "content-type", "accept", "x-shoal-model", "x-request-id"],
                expose_headers=[*CORS_EXPOSED],
                max_age=600,
            )
        )
    app = Starlette(
        middleware=middleware,
        routes=[
            Route(
                spec.path, endpoint(spec) if spec.plain is None else spec.plain, methods=[spec.method], name=spec.name
            )
            for spec in ROUTES
        ],
        exception_handlers={HTTPException: _on_http_error},
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.settings = settings
    app.state.openapi = msgspec.json.encode(openapi.describe(ROUTES))
    return app


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """The errors the router raises itself: 404 (no such path), 405 (wrong method; keeps its `Allow`)."""
    if not isinstance(exc, HTTPException):  # registered for HTTPException only (Starlette types it Exception)
        exc = HTTPException(500, str(exc))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    fmt = wire.format_of_accept(request.headers.get("accept"), wire.Format.JSON)
    return http_error(code, message, exc.status_code, headers=exc.headers, fmt=fmt)


@dataclass
class Preloading:
    """The preloads still loading, and those that failed (model id -> why, as a client may see it)."""

    loading: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    done: bool = False


async def _preload(service: Service, preloading: Preloading) -> None:
    """Load each preload in turn (then the cards that ask for it): a failure is one line in the log
    and in /readyz, not a traceback, and the others still load."""
    for model_id in [*preloading.loading, None]:  # None: the cards' own preloads, once
        try:
            await service.warm([model_id] if model_id else [])
        except ShoalError as exc:
            why = getattr(exc, "public_message", None) or exc.message
            preloading.failed[model_id or "cards"] = why
            log.error("preload of %s failed: %s", model_id or "the cards' preloads", why)
        finally:
            if model_id:
                preloading.loading.remove(model_id)
    preloading.done = True
    if preloading.failed:
        log.error("not ready: %d preload(s) failed (GET /readyz lists them)", len(preloading.failed))
    else:
        log.info("ready: preloaded models are loaded")


def _encode_large(result: object, fmt: wire.Format) -> bytes:
    """Encode a large response; runs in a worker thread so the event loop keeps serving."""
    return wire.encode(result, fmt)


def _request_id(request: Request) -> str:
    """The caller's `x-request-id` when it is a sane token, else a new one."""
    given = request.headers.get("x-request-id")
    if given and _REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex[:16]


async def _unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """`work`'s result; Cancelled (and `work` cancelled) if the client disconnects first.

    The body has been read, so the next ASGI message is `http.disconnect`, sent when the client
    closes its connection."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client went away, or this request was cancelled itself
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ShoalError):
                await task
    if not task.cancelled():
        return task.result()
    if watcher.done() and not watcher.cancelled() and watcher.exception() is None:
        raise Cancelled("the client disconnected before its answer; its queued work was dropped")
    raise Overloaded("the server is shutting down; retry on another replica", retry_after_s=1.0)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
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
