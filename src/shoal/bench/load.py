"""Load for `shoal bench`: HTTP targets and the two ways to drive them.

Open loop: requests start at Poisson arrival times for the offered rate, whether or not earlier
ones have finished (the way independent users arrive); closed loop: N clients, each sending its
next request when the last one returns. Either way request k sends call k mod len(calls), so every
target gets the same sequence. Bodies are encoded once, before the clock starts.
"""

from __future__ import annotations

import asyncio
import base64
import math
import random
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import msgspec

from ..errors import ConfigError
from .workloads import Call, Workload

# A step's in-flight requests past this many are refused on the client (counted as dropped): an
# overloaded target must not turn the load generator into the bottleneck.
MAX_INFLIGHT = 2048
# An open-loop level lasts long enough for about this many arrivals.
MIN_ARRIVALS = 20


@dataclass
class Outcome:
    ok: bool
    tokens: int = 0
    status: int = 0


@dataclass
class Step:
    """One load level: what was offered, what came back."""

    mode: str  # open | closed
    offered: float  # req/s (open) or clients (closed)
    duration_s: float  # from the first request to the last answer
    window_s: float = 0.0  # open loop: how long requests arrived
    sent: int = 0
    ok: int = 0
    errors: int = 0
    dropped: int = 0
    items: int = 0
    tokens: int = 0
    client_cpu_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def achieved_rps(self) -> float:
        return self.ok / self.duration_s if self.duration_s else 0.0

    @property
    def arrival_rps(self) -> float:
        """Open loop: requests that arrived per second of the arrival window."""
        return (self.sent + self.dropped) / self.window_s if self.window_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s if self.duration_s else 0.0

    @property
    def items_per_s(self) -> float:
        return self.items / self.duration_s if self.duration_s else 0.0

    @property
    def error_share(self) -> float:
        total = self.sent + self.dropped
        return (self.errors + self.dropped) / total if total else 0.0

    def percentile_ms(self, q: float) -> float | None:
        if not self.latencies_ms:
            return None
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]

    def summary(self) -> dict:
        return dict(
            mode=self.mode,
            offered=self.offered,
            duration_s=round(self.duration_s, 3),
            sent=self.sent,
            ok=self.ok,
            errors=self.errors,
            dropped=self.dropped,
            achieved_rps=round(self.achieved_rps, 2),
            items_per_s=round(self.items_per_s, 1),
            tokens_per_s=round(self.tokens_per_s, 1),
            p50_ms=_round(self.percentile_ms(50)),
            p90_ms=_round(self.percentile_ms(90)),
            p99_ms=_round(self.percentile_ms(99)),
            client_cpu_s=round(self.client_cpu_s, 2),
            statuses={str(k): v for k, v in sorted(self.statuses.items())},
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


class _Usage(msgspec.Struct):
    tokens: int = 0
    prompt_tokens: int = 0  # OpenAI shape


class _Reply(msgspec.Struct):
    usage: _Usage | None = None


class HttpTarget:
    """A server driven over HTTP. `wire`: "native" (shoal's /v1/encode|score|extract, JSON or
    msgpack; image files as base64 in JSON, raw bytes in msgpack) or "openai" (/v1/embeddings, or
    `openai_path` for servers that mount it elsewhere: Infinity serves /embeddings; texts only).
    Tokens are read from each response's usage."""

    def __init__(
        self,
        name: str,
        url: str,
        model: str,
        workload: Workload,
        *,
        wire: str = "native",
        msgpack: bool = False,
        openai_path: str = "/v1/embeddings",
        timeout_s: float = 120.0,
        token: str | None = None,
        call_tokens: list[int] | None = None,
    ) -> None:
        if wire == "openai" and workload.verb != "encode":
            raise ValueError(f"the OpenAI route only embeds; workload {workload.name!r} is {workload.verb}")
        if wire == "openai" and workload.modality != "text":
            raise ValueError(f"the OpenAI route embeds texts; workload {workload.name!r} sends {workload.item_noun}")
        self.name, self.url, self.model, self.workload = name, url.rstrip("/"), model, workload
        # Tokens per call counted here (the model's tokenizer): used instead of the response's usage
        # when given (Infinity's usage counts characters).
        self.call_tokens = call_tokens
        self.msgpack = msgpack and wire == "native"
        self.timeout_s = timeout_s
        path = openai_path if wire == "openai" else f"/v1/{workload.verb}"
        encode = msgspec.msgpack.encode if self.msgpack else msgspec.json.encode
        self._decode = msgspec.msgpack.Decoder(_Reply) if self.msgpack else msgspec.json.Decoder(_Reply)
        kind = "application/msgpack" if self.msgpack else "application/json"
        headers = {"content-type": kind, "accept": kind}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._pool = _Pool(self.url)
        # Each call's whole request (head and body), built before the clock starts.
        self._requests = [
            self._pool.request(path, headers, encode(_body(wire, model, workload.verb, call, raw_bytes=self.msgpack)))
            for call in workload.calls
        ]

    def items_of(self, k: int) -> int:
        return self.workload.calls[k % len(self.workload.calls)].num_items

    async def send(self, k: int) -> Outcome:
        try:
            status, content = await self._pool.exchange(self._requests[k % len(self._requests)], self.timeout_s)
        except (OSError, EOFError, asyncio.TimeoutError, httptools.HttpParserError):
            return Outcome(False, status=0)
        if status != 200:
            return Outcome(False, status=status)
        try:
            usage = self._decode.decode(content).usage
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Outcome(False, status=status)
        if self.call_tokens is not None:
            return Outcome(True, self.call_tokens[k % len(self.call_tokens)], 200)
        return Outcome(True, (usage.tokens or usage.prompt_tokens) if usage else 0, 200)

    async def aclose(self) -> None:
        self._pool.close()


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one exchange at a time. The response is parsed with
    httptools (uvicorn's parser), which also undoes a chunked transfer."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._reply: asyncio.Future | None = None
        self._body: list[bytes] = []
        self.reusable = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def eof_received(self) -> bool | None:
        self.reusable = False  # the server is closing it: not for the next exchange
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(exc or EOFError("the server closed the connection before it answered"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._body = []

    def on_body(self, chunk: bytes) -> None:
        self._body.append(chunk)

    def on_message_complete(self) -> None:
        reply, self._reply = self._reply, None
        self.reusable = self._parser.should_keep_alive()
        if reply is not None and not reply.done():
            reply.set_result((self._parser.get_status_code(), b"".join(self._body)))

    def _fail(self, exc: Exception) -> None:
        reply, self._reply = self._reply, None
        if reply is not None and not reply.done():
            reply.set_exception(exc)
        self.close()

    async def exchange(self, request: bytes, timeout_s: float) -> tuple[int, bytes]:
        if self._transport is None or self._transport.is_closing():
            raise EOFError("the connection is closed")
        loop = asyncio.get_running_loop()
        self.reusable = False  # until this exchange's response has been read whole
        self._reply = reply = loop.create_future()
        late = loop.call_later(timeout_s, self._fail, TimeoutError(f"no answer within {timeout_s} s"))
        self._transport.write(request)
        try:
            return await reply
        finally:
            late.cancel()

    def close(self) -> None:
        self.reusable = False
        if self._transport is not None:
            self._transport.close()


class _Pool:
    """Keep-alive connections to one server, each lent to one exchange at a time, and as many as
    there are exchanges in flight (the load loops cap those). About 0.1 ms of client CPU per
    request, against ~3 ms with httpx's AsyncClient: the load generator shares the cores with the
    server it measures, so its cost would be taken from the server's figures."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise ConfigError(f"a bench target's URL is http(s)://HOST[:PORT][/PATH], not {url!r}")
        self.host, self.tls = parts.hostname, parts.scheme == "https"
        self.port = port or (443 if self.tls else 80)
        self._tls = ssl.create_default_context() if self.tls else None
        self.prefix = parts.path.rstrip("/")
        self.authority = parts.netloc.rsplit("@", 1)[-1]
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    def request(self, path: str, headers: dict[str, str], body: bytes) -> bytes:
        """A POST of `body` to `path`, head and body as sent."""
        lines = [f"POST {self.prefix}{path} HTTP/1.1", f"host: {self.authority}", f"content-length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def exchange(self, request: bytes, timeout_s: float) -> tuple[int, bytes]:
        """(status, body) of one request within `timeout_s` (connecting included), on an idle
        connection or a new one. A connection that failed, timed out, was cancelled or was told to
        close is not reused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable:
                break
            self._forget(connection)
        else:
            connection = await self._open(timeout_s)
        try:
            answer = await connection.exchange(request, max(0.0, deadline - loop.time()))
        except BaseException:
            self._forget(connection)
            raise
        if connection.reusable:
            self._idle.append(connection)
        else:
            self._forget(connection)
        return answer

    async def _open(self, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        _, connection = await asyncio.wait_for(
            loop.create_connection(_Connection, self.host, self.port, ssl=self._tls), timeout_s
        )
        self._all.add(connection)
        return connection

    def _forget(self, connection: _Connection) -> None:
        connection.close()
        self._all.discard(connection)

    def close(self) -> None:
        for connection in self._all:
            connection.close()
        self._all.clear()
        self._idle.clear()


def _body(wire: str, model: str, verb: str, call: Call, *, raw_bytes: bool = False) -> dict:
    """A call's request body; `raw_bytes`: image files as they are (msgpack `bin`), else base64."""
    if wire == "openai":
        return {"model": model, "input": list(call.texts)}
    items: list[dict] = [{"text": t} for t in call.texts]
    items += [{"image": f if raw_bytes else base64.b64encode(f).decode("ascii")} for f in call.images]
    if verb == "score":
        return {"model": model, "query": call.query, "items": items}
    body: dict = {"model": model, "items": items}
    if verb == "extract" and call.labels:
        body["labels"] = list(call.labels)
    if verb == "extract" and call.schema:
        body["schema"] = dict(call.schema)
    return body


async def _timed(target, k: int, step: Step) -> None:
    started = time.perf_counter()
    outcome = await target.send(k)
    step.statuses[outcome.status] = step.statuses.get(outcome.status, 0) + 1
    if outcome.ok:
        step.ok += 1
        step.tokens += outcome.tokens
        step.items += target.items_of(k)
        step.latencies_ms.append((time.perf_counter() - started) * 1000)
    else:
        step.errors += 1


async def open_loop(
    target, rate: float, duration_s: float, *, seed: int = 0, first: int = 0, drain_s: float = 60.0
) -> Step:
    """Requests at Poisson arrivals of `rate`/s for `duration_s` (stretched to at least
    MIN_ARRIVALS / rate, so a slow level still sees enough requests to judge); then waits (up to
    `drain_s`) for those in flight. The step lasts until the last answer, so a backlog lowers its rate."""
    if not (math.isfinite(rate) and rate > 0 and math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"an open-loop level needs a finite rate and duration > 0, not {rate}, {duration_s}")
    duration_s = max(duration_s, MIN_ARRIVALS / rate)
    step = Step("open", rate, duration_s, window_s=duration_s)
    rng = random.Random(seed)
    tasks: set[asyncio.Task] = set()
    cpu0, start = time.process_time(), time.perf_counter()
    at, k = start, first
    while True:
        at += rng.expovariate(rate)
        if at - start >= duration_s:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= MAX_INFLIGHT:
            step.dropped += 1
            continue
        task = asyncio.create_task(_timed(target, k, step))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        step.sent += 1
        k += 1
    if tasks:
        _, late = await asyncio.wait(set(tasks), timeout=drain_s)
        for task in late:
            task.cancel()
        step.errors += len(late)
    step.duration_s = max(duration_s, time.perf_counter() - start)
    step.client_cpu_s = time.process_time() - cpu0
    return step


async def closed_loop(target, clients: int, duration_s: float, *, first: int = 0) -> Step:
    """`clients` clients, each sending its next request when its last one returns, for `duration_s`
    (requests started before the end are waited for and counted)."""
    if clients < 1 or not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(
            f"a closed-loop level needs >= 1 client and a finite duration > 0, not {clients}, {duration_s}"
        )
    step = Step("closed", clients, duration_s)
    counter = iter(range(first, first + 10**9))
    cpu0, start = time.process_time(), time.perf_counter()
    end = start + duration_s

    async def client() -> None:
        while time.perf_counter() < end:
            step.sent += 1
            await _timed(target, next(counter), step)

    await asyncio.gather(*(client() for _ in range(clients)))
    step.duration_s = time.perf_counter() - start
    step.client_cpu_s = time.process_time() - cpu0
    return step
