"""The one map from shoal errors to HTTP status, and the one error body shape.

{"error": {"code": "...", "message": "...", "details": {...}}}
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from starlette.responses import Response

from .. import wire
from ..errors import (
    Cancelled,
    DeadLetter,
    DeadlineExceeded,
    Forbidden,
    InferenceFailed,
    InputTooLong,
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    PayloadTooLarge,
    ShoalError,
    Unauthorized,
    UnknownModel,
    UnsupportedMediaType,
)

# Most specific first: the first class the error is an instance of decides.
_STATUS: tuple[tuple[type[ShoalError], int], ...] = (
    (UnknownModel, 404),
    (UnsupportedMediaType, 415),
    (PayloadTooLarge, 413),
    (InputTooLong, 422),
    (InvalidRequest, 400),
    (Unauthorized, 401),
    (Forbidden, 403),
    (Overloaded, 503),
    (DeadlineExceeded, 504),
    (Cancelled, 499),  # nginx's code: the client went away before its answer (nobody reads it)
    (InferenceFailed, 500),
    # The model is served but loading it failed (weights missing or broken): an upstream failure,
    # not the caller's fault; Retry-After says when the next attempt is (engine/cache.py backs off).
    (ModelLoadError, 502),
    (DeadLetter, 502),  # the workers failed on it: an upstream failure; the body has the request id
    (ShoalError, 500),
)


def status_of(error: ShoalError) -> int:
    return next(status for cls, status in _STATUS if isinstance(error, cls))


def error_response(error: ShoalError, fmt: wire.Format = wire.Format.JSON) -> Response:
    body = wire.ErrorResponse(wire.ErrorBody(code=error.code, message=error.message, details=error.details))
    headers = {}
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="shoal"'
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return Response(wire.encode(body, fmt), status_code=status_of(error), media_type=fmt.value, headers=headers)


def http_error(
    code: str, message: str, status: int, headers: Mapping[str, str] | None = None, fmt: wire.Format = wire.Format.JSON
) -> Response:
    """For errors the router raises itself (unknown path, wrong method: keeps its `Allow`)."""
    body = wire.ErrorResponse(wire.ErrorBody(code=code, message=message))
    return Response(wire.encode(body, fmt), status_code=status, media_type=fmt.value, headers=dict(headers or {}))
