"""One pooled HTTP connection to a shoal server: bodies in msgpack or JSON, bearer auth, retries.

A request is retried when retrying can help: `503` and `429` (the queue is full, a model is
loading), `502` that carries `Retry-After` (a model load failed and the server says when it tries
again), and transport errors short of a read timeout (connection refused or reset). Each retry
waits `max(Retry-After, exponential back-off)`, stretched by up to a quarter of random jitter so
that many clients do not come back at once; never less than the server asked for. A wait that
would end past the call's deadline is not taken: the last error is raised at once. Everything else
raises at once, as the `shoal.errors` class its body's `code` names (`error_from_code`).
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

try:
    import httpx
except ImportError as exc:  # the base install serves; the client needs the `sdk` extra
    raise ImportError("shoal.sdk needs httpx: pip install 'shoal[sdk]'") from exc

from .. import wire
from ..errors import DeadlineExceeded, ShoalError, error_from_code

RETRY_STATUSES = frozenset({429, 503})
BACKOFF_BASE_S = 0.1  # the first wait without Retry-After; doubles per attempt
BACKOFF_MAX_S = 10.0
MAX_RETRY_AFTER_S = 60.0  # the longest Retry-After honoured
JITTER = 0.25  # each wait is stretched by a random 0..25 %

# A body that is not shoal's error shape (a proxy's 502 page): the code its status stands for.
_CODE_OF_STATUS = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "input_too_long",
    429: "overloaded",
    503: "overloaded",
    504: "deadline_exceeded",
}

FORMATS = {"msgpack": wire.Format.MSGPACK, "json": wire.Format.JSON}

T = TypeVar("T")
# Builds a request's body (a wire Struct) from the seconds the server may take (None: no deadline).
BodyMaker = Callable[[float | None], object]


class Http:
    """Sends one logical request as up to `1 + max_retries` attempts over a pooled httpx.AsyncClient."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        timeout_s: float,
        max_retries: int,
        format: str,
        transport: httpx.AsyncBaseTransport | None,
        headers: dict[str, str] | None,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be 'msgpack' or 'json', not {format!r}")
        self.format = FORMATS[format]
        self.max_retries = max_retries
        sent = {"Content-Type": self.format.value, "Accept": self.format.value, **(headers or {})}
        if api_key is not None:
            sent["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=sent, transport=transport, timeout=timeout_s
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def post(self, path: str, make_body: BodyMaker, response_type: type[T], deadline: float | None) -> T:
        """POST `make_body(server_timeout_s)` (a wire Struct, rebuilt per attempt so the server's
        `timeout_s` is what is left of the deadline); the answer decoded as `response_type`."""
        response = await self.send("POST", path, make_body, deadline)
        return _decode(response, response_type)

    async def get(self, path: str, deadline: float | None) -> object:
        """GET `path`; the answer as plain JSON values (dicts, lists, strings, numbers)."""
        return _decode(await self.send("GET", path, None, deadline), object)

    async def send(self, method: str, path: str, make_body: BodyMaker | None, deadline: float | None) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            left_s = _left_s(deadline)
            content = None if make_body is None else wire.encode(make_body(left_s), self.format)
            request = self.client.request(method, path, content=content)
            try:
                # httpx's timeout bounds each read and write; the deadline bounds the whole exchange.
                response = await (request if left_s is None else asyncio.wait_for(request, left_s))
            except asyncio.TimeoutError as exc:
                raise DeadlineExceeded(
                    f"{method} {path}: the client's deadline passed", details={"phase": "client"}
                ) from exc
            except httpx.TimeoutException as exc:
                if isinstance(exc, httpx.ReadTimeout) or attempt == self.max_retries:
                    raise  # the server took the request: sending it again doubles its load
                wait_s = _backoff_s(attempt, None)
                error: BaseException = exc
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise
                wait_s, error = _backoff_s(attempt, None), exc
            else:
                if response.is_success:
                    return response
                error = error_of(response)
                retry_after_s = _retry_after_s(response)
                retryable = response.status_code in RETRY_STATUSES or (
                    response.status_code == 502 and retry_after_s is not None
                )
                if not retryable or attempt == self.max_retries:
                    raise error
                wait_s = _backoff_s(attempt, retry_after_s)
            if deadline is not None and time.monotonic() + wait_s > deadline:
                raise error
            await asyncio.sleep(wait_s)
        raise AssertionError("unreachable: the last attempt returns or raises")


def _left_s(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left_s = deadline - time.monotonic()
    if left_s <= 0:
        raise DeadlineExceeded("the client's deadline passed before the request was sent", details={"phase": "client"})
    return left_s


def _backoff_s(attempt: int, retry_after_s: float | None) -> float:
    """The wait before retry `attempt`: the server's Retry-After (at most MAX_RETRY_AFTER_S: a proxy
    asking for an hour is not waited on), or a doubling back-off, with jitter."""
    backoff_s = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0**attempt)
    asked_s = min(retry_after_s or 0.0, MAX_RETRY_AFTER_S)
    return max(asked_s, backoff_s) * (1.0 + random.uniform(0.0, JITTER))


def _retry_after_s(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds: a number, or an HTTP date; None when absent or unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


def error_of(response: httpx.Response) -> ShoalError:
    """The shoal error a non-2xx answer carries, rebuilt as its own class from the body's code."""
    retry_after_s = _retry_after_s(response)
    try:
        body = _decode(response, wire.ErrorResponse).error
    except (msgspec.DecodeError, msgspec.ValidationError, ShoalError):
        code = _CODE_OF_STATUS.get(response.status_code, "internal_error")
        text = response.text[:200] if response.content else ""
        return error_from_code(
            code, f"HTTP {response.status_code}: {text}".rstrip(": "), {"status": response.status_code}, retry_after_s
        )
    return error_from_code(body.code, body.message, body.details, retry_after_s)


def _decode(response: httpx.Response, type: type[T]) -> T:
    fmt = wire.format_of_content_type(response.headers.get("content-type"))
    if fmt is wire.Format.MSGPACK:
        return msgspec.msgpack.decode(response.content, type=type)
    return msgspec.json.decode(response.content, type=type)
