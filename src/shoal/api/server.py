"""`build_server(app, settings)`: uvicorn with the limits a server facing the network needs.

uvicorn has a keep-alive timeout and a listen backlog, but over httptools it has no bound on header
size, no header or body read timeout and no cap on open connections (its `limit_concurrency`
answers 503 only once a request's headers have arrived, so idle connections still pile up until
the process runs out of file descriptors). `LimitedHttpProtocol` adds them to uvicorn's httptools
protocol:

    limit                  trips when                                              answer
    max_header_bytes       request line + headers grow past it                     431, close
    header_read_timeout_s  a head is not complete this long after the connection   408, close
                           opens or after its first byte arrives
    body_read_timeout_s    no body byte arrives for this long, body incomplete     408, close
    max_connections        a connection opens while this many are open             503, close
                           (idle keep-alive ones count)
    keep_alive_timeout_s   a keep-alive connection idles this long                 closed (uvicorn)

Refusals carry the one error body, `{"error": {"code", "message", "details"}}`, and
`Connection: close`. The connection is then half-closed and drained for up to `LINGER_S`, so a
client still sending its request reads the answer instead of a TCP reset.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ..config import ServerSettings

log = logging.getLogger("shoal.server")

# How long a refused connection is drained before it is closed outright.
LINGER_S = 1.0
# At most one "connection cap reached" warning per this many seconds.
WARN_INTERVAL_S = 10.0


@dataclass
class _Gate:
    """Runtime state shared by one server's connections (measured values, never settings)."""

    max_connections: int
    # Connections draining after a refusal hold a descriptor each; past this many, close at once.
    max_lingering: int
    lingering: int = 0
    last_warned_s: float = float("-inf")


def fd_limit() -> int | None:
    """The process's soft limit on open file descriptors; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(max_connections: int, fd_limit: int | None) -> int:
    """`max_connections`, lowered so that open connections leave descriptors for the process
    (weights, logs, the listening socket) and for refusing the next clients cleanly: past the
    descriptor limit, `accept` fails with EMFILE and new clients hang instead of reading a 503."""
    if fd_limit is None:
        return max_connections
    reserve = max(64, fd_limit // 8)
    return max(1, min(max_connections, fd_limit - reserve))


def build_server(app: ASGIApp, settings: ServerSettings, *, log_level: str | int | None = "info") -> uvicorn.Server:
    """A uvicorn server for `app` on `settings.host:settings.port` with every limit of `settings`.

    `server.run()` serves until SIGINT/SIGTERM; `server.run(sockets=[sock])` serves on a socket
    already bound (tests).
    """
    limit = fd_limit()
    cap = connection_cap(settings.max_connections, limit)
    if cap < settings.max_connections:
        log.warning(
            "max_connections %d lowered to %d to stay below the file-descriptor limit %s; raise `ulimit -n` for more",
            settings.max_connections,
            cap,
            limit,
        )
    headroom = (limit - cap) if limit is not None else 10 * cap
    gate = _Gate(max_connections=cap, max_lingering=max(1, headroom // 2))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=functools.partial(LimitedHttpProtocol, limits=settings, gate=gate),  # type: ignore[arg-type]
        lifespan="on",  # a failing startup (engine, preload) stops the server instead of serving without it
        log_level=log_level,
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # call_later takes a float
        backlog=settings.listen_backlog,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    return uvicorn.Server(config)


def serve(app: ASGIApp, settings: ServerSettings, *, log_level: str | int | None = "info") -> None:
    """Serve `app` until SIGINT/SIGTERM (`shoal serve`)."""
    build_server(app, settings, log_level=log_level).run()


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header, timeout and connection limits of `limits`.

    A connection is in one of three phases: reading a head (request line and headers; a fresh
    connection starts here), reading a body, or idle between requests (uvicorn's keep-alive timer).
    """

    def __init__(self, *args: Any, limits: ServerSettings, gate: _Gate, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.gate = gate
        self._in_head = True  # the next bytes received belong to a request head
        self._head_bytes = 0  # bytes of the current head fed to the parser
        self._heads_seen = 0
        self._reading_body = False
        self._body_seen_s = 0.0  # loop time of the last body byte (or of the end of the head)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._counted_lingering = False

    # --- connection ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        num_open = len(self.connections)
        if num_open >= self.gate.max_connections:
            self.transport = transport  # never joins `connections`: it is refused, not served
            self._warn_cap(num_open)
            self._reject(
                503,
                "too_many_connections",
                f"the server has {num_open} open connections, its limit; retry later",
                {"max_connections": self.gate.max_connections},
                extra_headers=[(b"retry-after", b"1")],
            )
            return
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.limits.header_read_timeout_s, self._on_head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._counted_lingering:
            self.gate.lingering -= 1
            self._counted_lingering = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # drained and dropped: the answer is already written
        if not self._in_head:
            super().data_received(data)
        else:
            if self._head_timer is None:  # first byte of a head on a kept-alive connection
                self._head_timer = self.loop.call_later(self.limits.header_read_timeout_s, self._on_head_timeout)
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                super().data_received(data)
            else:
                # Feed only what the limit allows: the parser buffers a header until it ends, so
                # it must never see more than `max_header_bytes` of one head.
                heads_seen = self._heads_seen
                super().data_received(data[:room])
                if self.transport.is_closing():
                    return
                if self._heads_seen == heads_seen:
                    limit = self.limits.max_header_bytes
                    self._reject(
                        431,
                        "headers_too_large",
                        f"request line and headers exceed the limit of {limit} bytes",
                        {"limit_bytes": limit},
                    )
                    return
                super().data_received(data[room:])
        if self._reading_body and self._body_timer is None and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.limits.body_read_timeout_s, self._on_body_timeout)

    # --- parser callbacks ------------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads_seen += 1
        self._cancel_timer("_head_timer")
        # An upgraded connection leaves this protocol; no body timer may outlive it.
        self._reading_body = not self.parser.should_upgrade()
        self._body_seen_s = self.loop.time()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_seen_s = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._reading_body = False
        self._cancel_timer("_body_timer")
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()

    # --- timers ----------------------------------------------------------------------------------

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head or self._lingering or self.transport.is_closing():
            return
        timeout_s = self.limits.header_read_timeout_s
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head waits behind a response in flight; its clock starts over.
            self._head_timer = self.loop.call_later(timeout_s, self._on_head_timeout)
            return
        self._reject(
            408,
            "request_timeout",
            f"request headers were not complete within {timeout_s:g} s",
            {"timeout_s": timeout_s},
        )

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if not self._reading_body or self._lingering or self.transport.is_closing():
            return
        now, timeout_s = self.loop.time(), self.limits.body_read_timeout_s
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            self._body_seen_s = now  # the client waits on us (backpressure, 100-continue), not we on it
        remaining_s = self._body_seen_s + timeout_s - now
        if remaining_s > 0:
            self._body_timer = self.loop.call_later(remaining_s, self._on_body_timeout)
            return
        self._reject(
            408,
            "request_timeout",
            f"the request body stalled: no bytes for {timeout_s:g} s before it was complete",
            {"timeout_s": timeout_s},
            answer=cycle is None or not cycle.response_started,
        )

    def _cancel_timer(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _cancel_timers(self) -> None:
        for name in ("_head_timer", "_body_timer", "_linger_timer"):
            self._cancel_timer(name)

    # --- refusing --------------------------------------------------------------------------------

    def _reject(
        self,
        status: int,
        code: str,
        message: str,
        details: dict[str, object],
        *,
        answer: bool = True,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Answer `status` (unless a response has started), then half-close and drain."""
        if status != 503:
            log.info("%s: %d %s", _peer(self.client), status, message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's reads end now and its late answer is dropped
            cycle.message_event.set()
        if answer:
            body = json.dumps({"error": {"code": code, "message": message, "details": details}}).encode()
            head = [STATUS_LINE[status]]
            headers = [
                *self.server_state.default_headers,
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *(extra_headers or []),
            ]
            head += [b"%s: %s\r\n" % (name, value) for name, value in headers]
            self.transport.write(b"".join([*head, b"\r\n", body]))
        self._linger()

    def _linger(self) -> None:
        # Closing a socket with unread input makes the kernel send a reset, which can destroy the
        # answer before the client reads it; so stop writing, read and drop input, close later.
        self._lingering = True
        self._in_head = self._reading_body = False
        self._cancel_timers()
        self._unset_keepalive_if_required()
        if self.gate.lingering >= self.gate.max_lingering or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.gate.lingering += 1
        self._counted_lingering = True
        if self.flow is not None:
            self.flow.resume_reading()
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _warn_cap(self, num_open: int) -> None:
        now = self.loop.time()
        if now - self.gate.last_warned_s >= WARN_INTERVAL_S:
            self.gate.last_warned_s = now
            log.warning("refusing new connections with 503: %d open, the limit (max_connections)", num_open)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "-"
