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
    max_connections        a connection opens while this many are open, and none   503, close
                           of them is idle (see below)
    keep_alive_timeout_s   a keep-alive connection idles this long                 closed (uvicorn)

A connection is idle while it has no request in flight: freshly opened, between kept-alive
requests, or part way through a head. At the cap, a new connection is let in by closing an idle
one, never a busy one: the oldest idle connection of the peer (client address) that holds the most
connections. So a peer that opens silent sockets by the thousand only ever displaces its own, and a
fresh client gets in as soon as any idle connection exists. A peer already holding at least as many
connections as the one it would displace is refused instead, so no peer grows past another's share
by taking its connections. An idle connection closed part way through a head is answered 503
(`connection_evicted`); one with nothing sent is closed.

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
from collections import Counter
from dataclasses import dataclass, field
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
    last_evicted_warned_s: float = float("-inf")
    # Open (accepted) connections per peer address, and each peer's idle ones, oldest first.
    open_by_peer: Counter[str] = field(default_factory=Counter)
    idle_by_peer: dict[str, dict[LimitedHttpProtocol, None]] = field(default_factory=dict)

    def set_idle(self, conn: LimitedHttpProtocol, idle: bool) -> None:
        """Mark `conn` idle (moved to the newest end) or busy."""
        peers = self.idle_by_peer
        conns = peers.get(conn.peer)
        if conns is not None:
            conns.pop(conn, None)
        if idle:
            if conns is None:
                conns = peers[conn.peer] = {}
            conns[conn] = None
        elif conns is not None and not conns:
            del peers[conn.peer]

    def victim(self, newcomer: str) -> LimitedHttpProtocol | None:
        """The idle connection to close so that a connection from `newcomer` can open: the oldest
        idle one of the peer holding the most connections; None when there is no idle connection,
        or when `newcomer` already holds as many connections as that peer (it takes only its own)."""
        if not self.idle_by_peer:
            return None
        peer = max(self.idle_by_peer, key=lambda p: (self.open_by_peer[p], p == newcomer))
        if peer != newcomer and self.open_by_peer[newcomer] >= self.open_by_peer[peer]:
            return None
        return next(iter(self.idle_by_peer[peer]))


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
        lifespan="on",  # a failing engine start stops the server; preloads load after it binds (api/app.py)
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
        self.peer = "-"  # the client's address: connections are shared out per peer
        self._counted_open = False  # counted in gate.open_by_peer (an accepted connection)
        self._unparsable: str | None = None  # why the bytes after the requests in flight could not be parsed

    # --- connection ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if isinstance(peername, tuple) and peername else "-"
        num_open = len(self.connections)
        if num_open >= self.gate.max_connections:
            victim = self.gate.victim(self.peer)
            if victim is None:
                self.transport = transport  # never joins `connections`: it is refused, not served
                self._warn_cap(num_open)
                self._reject(
                    503,
                    "too_many_connections",
                    f"the server has {num_open} open connections, its limit, and none of them is idle; retry later",
                    {"max_connections": self.gate.max_connections},
                    extra_headers=[(b"retry-after", b"1")],
                )
                return
            self._warn_evicted(victim.peer)
            victim._evict()
        super().connection_made(transport)
        self.gate.open_by_peer[self.peer] += 1
        self._counted_open = True
        self.gate.set_idle(self, True)
        self._head_timer = self.loop.call_later(self.limits.header_read_timeout_s, self._on_head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._counted_lingering:
            self.gate.lingering -= 1
            self._counted_lingering = False
        if self._counted_open:
            self._counted_open = False
            self.gate.set_idle(self, False)
            self.gate.open_by_peer[self.peer] -= 1
            if not self.gate.open_by_peer[self.peer]:
                del self.gate.open_by_peer[self.peer]
        super().connection_lost(exc)

    def _evict(self) -> None:
        """Close this idle connection to make room for a new one (the server is at its cap)."""
        self.gate.set_idle(self, False)
        if self._head_bytes:
            self._reject(
                503,
                "connection_evicted",
                "the server is at its connection limit and closed this connection, which had sent only "
                "part of a request head; retry",
                {"max_connections": self.gate.max_connections},
                extra_headers=[(b"retry-after", b"1")],
            )
        else:
            self._cancel_timers()
            self._unset_keepalive_if_required()
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._unparsable is not None:
            return  # drained and dropped: the answer is already written, or the stream cannot be parsed
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
        self.gate.set_idle(self, False)
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

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or self._lingering or self.pipeline:
            return
        if self._unparsable is not None:
            self._refuse_unparsable(self._unparsable)
        else:
            self.gate.set_idle(self, True)

    def send_400_response(self, msg: str) -> None:
        """The parser failed (uvicorn calls this). Requests parsed before the bad bytes are answered
        first; then the 400, and the connection closes."""
        if (self.cycle is not None and not self.cycle.response_complete) or self.pipeline:
            self._unparsable = msg
            self.flow.pause_reading()  # nothing after the bad bytes can be parsed; stop reading it
            return
        self._refuse_unparsable(msg)

    def _refuse_unparsable(self, msg: str) -> None:
        self._reject(400, "bad_http", f"{msg.rstrip('.')}: the bytes sent are not an HTTP/1.1 request", {})

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
        self.gate.set_idle(self, False)
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

    def _warn_evicted(self, peer: str) -> None:
        now = self.loop.time()
        if now - self.gate.last_evicted_warned_s >= WARN_INTERVAL_S:
            self.gate.last_evicted_warned_s = now
            log.warning(
                "at the connection limit (max_connections %d): closing idle connections of %s, the peer holding the "
                "most (%d), to let new ones in",
                self.gate.max_connections,
                peer,
                self.gate.open_by_peer[peer],
            )

    def _warn_cap(self, num_open: int) -> None:
        now = self.loop.time()
        if now - self.gate.last_warned_s >= WARN_INTERVAL_S:
            self.gate.last_warned_s = now
            log.warning("refusing new connections with 503: %d open, the limit (max_connections)", num_open)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "-"
