"""HTTP server limits (issue 6) over real HTTP: real uvicorn on loopback, built by
`shoal.api.server` as `shoal serve` builds it, driven from raw sockets, since no client library
sends a short body, a never-ending head or 100 KiB of headers on purpose.

One server for the module, with timeouts short enough to wait out, serves a small Starlette app
(so these tests do not depend on the engine); the last test shows the project's own app gets the
limits too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from conftest import running_server
from shoal.api.server import connection_cap
from shoal.config import ServerSettings, Settings

LIMITS = ServerSettings(
    header_read_timeout_s=1.0,
    body_read_timeout_s=1.0,
    keep_alive_timeout_s=2.0,
    max_connections=8,
)  # max_header_bytes keeps its production default, 64 KiB
SLACK_S = 1.0  # scheduling noise allowed past a timeout on a busy machine


# --- the server ---------------------------------------------------------------------------------


def _echo_app() -> Starlette:
    async def echo(request: Request) -> Response:
        body = await request.body()
        return JSONResponse({"num_bytes": len(body), "body": body.decode("latin-1")})

    async def ok(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def busy(request: Request) -> Response:
        BUSY_IN_FLIGHT[0] += 1
        try:
            while not BUSY_RELEASE.is_set():
                await asyncio.sleep(0.01)
        finally:
            BUSY_IN_FLIGHT[0] -= 1
        return JSONResponse({"status": "ok"})

    routes = [Route("/echo", echo, methods=["POST"]), Route("/readyz", ok), Route("/hello", ok), Route("/busy", busy)]
    return Starlette(routes=routes)


# /busy answers once BUSY_RELEASE is set: its connections hold a request in flight until then.
BUSY_RELEASE = threading.Event()
BUSY_IN_FLIGHT = [0]


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    with running_server(_echo_app(), LIMITS) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


# --- a raw HTTP/1.1 client ----------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict:
        return json.loads(self.body)["error"]


@contextlib.contextmanager
def connection(address: tuple[str, int], source: str = "127.0.0.1") -> Iterator[socket.socket]:
    """A connection from `source`, an address on loopback (the server shares connections out per peer)."""
    sock = socket.create_connection(address, timeout=10.0, source_address=(source, 0))
    try:
        yield sock
    finally:
        sock.close()


def request(
    path: str = "/hello", method: str = "GET", headers: dict[str, str] | None = None, body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def read_reply(sock: socket.socket) -> Reply:
    """The next response on `sock`; bytes past it stay unread in the socket only if it has none
    (a test reading two pipelined answers uses `read_replies`)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a complete response head: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in header_lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response body"
        body += chunk
    length = int(headers["content-length"])
    assert len(body) == length, f"bytes after the response: {body[length:]!r}"
    return Reply(int(status_line.split()[1]), headers, body)


def read_replies(sock: socket.socket, timeout_s: float) -> list[Reply]:
    """Every response on `sock` until the server closes it (within `timeout_s`)."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    replies = []
    while data:
        head, rest = data.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in header_lines)}
        length = int(headers["content-length"])
        replies.append(Reply(int(status_line.split()[1]), headers, rest[:length]))
        data = rest[length:]
    return replies


def closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server ends the connection cleanly (EOF, not a reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def assert_refused(reply: Reply, status: int, code: str) -> dict:
    assert reply.status == status, reply
    assert reply.headers["connection"] == "close"
    assert reply.headers["content-type"] == "application/json"
    error = reply.error()
    assert error["code"] == code and error["message"]
    return error["details"]


# --- body read timeout --------------------------------------------------------------------------


def test_body_shorter_than_content_length_gets_408_within_body_timeout(address):
    with connection(address) as sock:
        sock.sendall(request("/echo", "POST", {"Content-Length": "100"}, b"x" * 10))
        sent_s = time.monotonic()
        reply = read_reply(sock)
        waited_s = time.monotonic() - sent_s
        details = assert_refused(reply, 408, "request_timeout")
        assert details == {"timeout_s": LIMITS.body_read_timeout_s}
        assert LIMITS.body_read_timeout_s * 0.9 <= waited_s <= LIMITS.body_read_timeout_s + SLACK_S
        assert closed_by_server(sock, 1.0)


def test_body_trickled_within_body_timeout_is_served_though_it_takes_longer(address):
    # Three chunks 0.6 s apart: 1.8 s in all, past the 1 s timeout, which bounds gaps, not the total.
    chunks = [b"a" * 10, b"b" * 10, b"c" * 10]
    with connection(address) as sock:
        sock.sendall(request("/echo", "POST", {"Content-Length": "30"}))
        for chunk in chunks:
            time.sleep(0.6 * LIMITS.body_read_timeout_s)
            sock.sendall(chunk)
        reply = read_reply(sock)
    assert reply.status == 200
    assert json.loads(reply.body) == {"num_bytes": 30, "body": "a" * 10 + "b" * 10 + "c" * 10}


# --- header size --------------------------------------------------------------------------------


def test_headers_over_max_header_bytes_get_431(address):
    assert LIMITS.max_header_bytes == 64 * 1024
    padding = {f"X-Pad-{i}": "p" * 1000 for i in range(100)}  # ~100 KiB of headers
    with connection(address) as sock:
        sock.sendall(request("/hello", headers=padding))
        reply = read_reply(sock)
        details = assert_refused(reply, 431, "headers_too_large")
        assert details == {"limit_bytes": 64 * 1024}
        assert closed_by_server(sock, 1.0 + SLACK_S)


def test_one_header_over_max_header_bytes_gets_431(address):
    # One 100 KiB header: the parser buffers a header whole, so it must be cut off mid-value.
    with connection(address) as sock:
        sock.sendall(request("/hello", headers={"X-Big": "b" * 100 * 1024}))
        assert_refused(read_reply(sock), 431, "headers_too_large")


def test_headers_just_under_max_header_bytes_are_served(address):
    head = request("/echo", "POST", {"Content-Length": "2", "X-Pad": ""})
    padding = "p" * (LIMITS.max_header_bytes - len(head))  # head is exactly max_header_bytes long
    with connection(address) as sock:
        sock.sendall(request("/echo", "POST", {"Content-Length": "2", "X-Pad": padding}, b"ok"))
        reply = read_reply(sock)
    assert reply.status == 200
    assert json.loads(reply.body)["body"] == "ok"


# --- header read timeout ------------------------------------------------------------------------


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "one_byte_per_200ms"])
def test_headers_never_completed_get_408_after_header_timeout(address, trickle):
    # Slowloris: a byte every 200 ms does not restart the clock, which runs from the connection.
    with connection(address) as sock:
        opened_s = time.monotonic()
        if trickle:
            sock.sendall(b"GET /hello HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        deadline_s = opened_s + LIMITS.header_read_timeout_s + SLACK_S
        while not select.select([sock], [], [], 0.2)[0] and time.monotonic() < deadline_s:
            if trickle:
                sock.sendall(b"a")
        reply = read_reply(sock)
        waited_s = time.monotonic() - opened_s
        details = assert_refused(reply, 408, "request_timeout")
        assert details == {"timeout_s": LIMITS.header_read_timeout_s}
        assert LIMITS.header_read_timeout_s * 0.9 <= waited_s <= LIMITS.header_read_timeout_s + SLACK_S
        assert closed_by_server(sock, 1.0 + SLACK_S)


# --- connection cap and keep-alive --------------------------------------------------------------


def _hold_idle_connections(
    address, count: int, stack: contextlib.ExitStack, source: str = "127.0.0.1"
) -> list[socket.socket]:
    """`count` connections from `source`, each served one request and now idle in keep-alive."""
    deadline_s = time.monotonic() + 3.0
    while True:  # connections of earlier tests may take a moment to be closed on the server side
        with contextlib.ExitStack() as attempt:
            held = []
            for _ in range(count):
                sock = attempt.enter_context(connection(address, source))
                sock.sendall(request("/hello"))
                held.append((sock, read_reply(sock).status))
            if all(status == 200 for _, status in held) or time.monotonic() > deadline_s:
                assert [status for _, status in held] == [200] * count
                stack.enter_context(attempt.pop_all())
                return [sock for sock, _ in held]
        time.sleep(0.1)


def _hold_busy_connections(
    address, count: int, stack: contextlib.ExitStack, source: str = "127.0.0.1"
) -> list[socket.socket]:
    """`count` connections from `source`, each with a request in flight until BUSY is set."""
    held = []
    for _ in range(count):
        sock = stack.enter_context(connection(address, source))
        sock.sendall(request("/busy"))
        held.append(sock)
    deadline_s = time.monotonic() + 3.0
    while BUSY_IN_FLIGHT[0] < count and time.monotonic() < deadline_s:
        time.sleep(0.02)
    assert BUSY_IN_FLIGHT[0] == count
    return held


def _status(address, source: str = "127.0.0.1") -> int:
    with connection(address, source) as sock:
        sock.sendall(request("/hello"))
        return read_reply(sock).status


@pytest.fixture
def quiet_server(address) -> None:
    """The module's server with none of the earlier tests' connections left open."""
    deadline_s = time.monotonic() + 3.0
    while time.monotonic() < deadline_s:
        with contextlib.ExitStack() as stack:
            socks = [stack.enter_context(connection(address)) for _ in range(LIMITS.max_connections)]
            for sock in socks:
                sock.sendall(request("/hello"))
            if all(read_reply(sock).status == 200 for sock in socks):
                return
        time.sleep(0.1)


def test_at_the_cap_a_new_connection_displaces_the_oldest_idle_one_never_a_busy_one(address, quiet_server):
    with contextlib.ExitStack() as stack:
        held = _hold_idle_connections(address, LIMITS.max_connections, stack)
        assert _status(address) == 200  # the server was full, but only of idle connections
        assert closed_by_server(held[0], 1.0 + SLACK_S)  # the oldest idle one made room
        for sock in held[2:]:  # the newcomer displaced only one (the next went to the check above)
            sock.sendall(request("/hello"))
            assert read_reply(sock).status == 200


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503_and_the_busy_ones_are_answered(address, quiet_server):
    BUSY_RELEASE.clear()
    with contextlib.ExitStack() as stack:
        busy = _hold_busy_connections(address, LIMITS.max_connections, stack)
        try:
            with connection(address) as extra:
                extra.sendall(request("/hello"))  # sent at once, as clients do: the answer must survive it
                details = assert_refused(read_reply(extra), 503, "too_many_connections")
                assert details == {"max_connections": LIMITS.max_connections}
                assert closed_by_server(extra, 1.0 + SLACK_S)
        finally:
            BUSY_RELEASE.set()
        for sock in busy:
            assert read_reply(sock).status == 200


def test_a_peer_holding_many_idle_connections_gives_them_up_to_others_but_never_takes_theirs(address, quiet_server):
    BUSY_RELEASE.clear()
    with contextlib.ExitStack() as stack:
        try:
            busy = _hold_busy_connections(address, 5, stack, source="127.0.0.1")
            hog = _hold_idle_connections(address, LIMITS.max_connections - 5, stack, source="127.0.0.2")
            # 127.0.0.1 already holds more than 127.0.0.2: it may not take 127.0.0.2's idle connections.
            with connection(address, "127.0.0.1") as extra:
                extra.sendall(request("/hello"))
                assert_refused(read_reply(extra), 503, "too_many_connections")
            # A third peer may: the oldest idle connection of the peer holding the most goes.
            assert _status(address, "127.0.0.3") == 200
            assert closed_by_server(hog[0], 1.0 + SLACK_S)
        finally:
            BUSY_RELEASE.set()
        for sock in busy:
            assert read_reply(sock).status == 200
        hog[1].sendall(request("/hello"))
        assert read_reply(hog[1]).status == 200


def test_an_idle_connection_part_way_through_its_head_is_told_why_it_is_closed(address, quiet_server):
    with contextlib.ExitStack() as stack:
        partial = stack.enter_context(connection(address))
        partial.sendall(b"GET /hello HTTP/1.1\r\nHost: te")
        time.sleep(0.1)
        _hold_idle_connections(address, LIMITS.max_connections - 1, stack)
        assert _status(address) == 200
        details = assert_refused(read_reply(partial), 503, "connection_evicted")
        assert details == {"max_connections": LIMITS.max_connections}


# --- bytes that are not HTTP ----------------------------------------------------------------------


def test_a_request_followed_by_bytes_that_are_not_http_is_answered_before_the_400(address):
    with connection(address) as sock:
        body = b'{"hello": "world"}'
        sock.sendall(
            request("/echo", "POST", {"Content-Length": str(len(body))}, body) + b"\x16\x03\x01 not http\r\n\r\n"
        )
        first, second = read_replies(sock, 2.0 + SLACK_S)
        assert first.status == 200 and json.loads(first.body)["body"] == body.decode()
        assert_refused(second, 400, "bad_http")


def test_bytes_that_are_not_http_get_400(address):
    with connection(address) as sock:
        sock.sendall(b"\x16\x03\x01\x02\x00 hello\r\n\r\n")
        reply = read_reply(sock)
        assert_refused(reply, 400, "bad_http")
        assert "not an HTTP/1.1 request" in reply.error()["message"]
        assert closed_by_server(sock, 1.0 + SLACK_S)


def test_idle_keep_alive_connection_is_closed_after_keep_alive_timeout(address):
    with connection(address) as sock:
        sock.sendall(request("/hello"))
        assert read_reply(sock).status == 200
        idle_from_s = time.monotonic()
        assert closed_by_server(sock, LIMITS.keep_alive_timeout_s + SLACK_S)
        idle_s = time.monotonic() - idle_from_s
    assert LIMITS.keep_alive_timeout_s * 0.9 <= idle_s <= LIMITS.keep_alive_timeout_s + SLACK_S


# --- settings -----------------------------------------------------------------------------------


def test_connection_cap_stays_below_the_file_descriptor_limit():
    assert connection_cap(1000, fd_limit=20000) == 1000
    assert connection_cap(1000, fd_limit=None) == 1000
    assert connection_cap(1000, fd_limit=1024) == 1024 - 128  # a common default `ulimit -n`
    assert connection_cap(1000, fd_limit=64) == 1


def test_limits_are_read_from_the_environment():
    env = {
        "SHOAL_MAX_HEADER_BYTES": "4096",
        "SHOAL_HEADER_READ_TIMEOUT_S": "2.5",
        "SHOAL_BODY_READ_TIMEOUT_S": "7",
        "SHOAL_KEEP_ALIVE_TIMEOUT_S": "0.5",
        "SHOAL_MAX_CONNECTIONS": "12",
        "SHOAL_LISTEN_BACKLOG": "64",
    }
    server = Settings.from_env(env).server
    assert (server.max_header_bytes, server.header_read_timeout_s, server.body_read_timeout_s) == (4096, 2.5, 7.0)
    assert (server.keep_alive_timeout_s, server.max_connections, server.listen_backlog) == (0.5, 12, 64)
    assert Settings.from_env({}).server == ServerSettings()


# --- production wiring --------------------------------------------------------------------------


def test_project_app_is_served_with_its_header_limit(serve):
    url = serve(server=ServerSettings(max_header_bytes=4096))
    host, port = url.removeprefix("http://").split(":")
    with connection((host, int(port))) as sock:
        sock.sendall(request("/healthz", headers={"X-Pad": "p" * 1024}))
        assert read_reply(sock).status == 200
        sock.sendall(request("/healthz", headers={"X-Pad": "p" * 8192}))
        assert assert_refused(read_reply(sock), 431, "headers_too_large") == {"limit_bytes": 4096}
