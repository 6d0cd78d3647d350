"""A simulated NATS with JetStream, in virtual time, for bench/cluster_sim.py: the real gateway
(`RemoteService`) and the real `Worker` (its `Puller`s and `HostQueue`) run unmodified against it.

    Bus              the server: core subjects (wildcards, queue groups), streams, pull consumers
      Stream         a work-queue stream: one FIFO `Server` stores what is published (nats-server
                     ingests a stream's messages under its one lock), so one stream saturates
      Consumer       a durable pull consumer, one FIFO `Server` of its own for its pull requests,
                     deliveries and acks (nats-server: the consumer's lock and goroutine);
                     pending pull requests served in arrival order (409 past max_waiting),
                     redelivery after ack_wait, naks with a delay, max-deliveries advisories into
                     the dead-letter stream
      api            JetStream's API requests (consumer info, ...): one FIFO `Server`
    Connection       what `nats.connect` returns (publish, subscribe, jetstream(), ...); a client's
                     own work (the gateway's per call, a worker's per pulled call) is a `Server` too

It runs on virtual_time.VirtualLoop. Every hop between a client and the server costs `latency_s`.
Only the costs here take virtual time: the shoal code itself runs in zero virtual time, which is
why its costs are measured on the real thing (cluster_sim.py calibrate) and charged here. Core
messages are routed without a queue (nats-server spreads them over its connections' goroutines);
`core_s` counts only towards the server's CPU (`cpu_s`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import nats.errors
import nats.js.errors

MAX_PAYLOAD = 1024 * 1024
DUPLICATE_WINDOW_S = 120.0  # shoal's stream's
PULL_API = "$JS.API.CONSUMER.MSG.NEXT."


# --- costs and the queues that charge them ------------------------------------------------------


@dataclass(frozen=True)
class BusCosts:
    """Seconds of nats-server per operation (a stream's server: publish; a consumer's: the rest),
    and the network's one-way latency."""

    publish_s: float  # store a published message and send its PubAck
    deliver_s: float  # send one stored message to a pull request
    ack_s: float  # an ack, nak, in_progress or term
    fetch_s: float  # take one pull request
    status_s: float  # end one with a status: expired (408), or refused past max_waiting (409)
    core_s: float  # route one core message to one subscriber
    latency_s: float = 0.0001
    api_s: float = 0.0  # one JetStream API request (consumer info, ...), on the server's API queue


@dataclass(frozen=True)
class ClientCosts:
    """Seconds of a client's own (single) event loop per message it handles."""

    publish_s: float = 0.0  # a JetStream publish (the gateway's call), its PubAck included
    receive_s: float = 0.0  # a core message in (the gateway: a reply)
    heartbeat_s: float = 0.0  # a heartbeat in (the gateway)
    pulled_s: float = 0.0  # a pulled message (the worker: taking, running, replying and acking a call)


class Server:
    """A single-server FIFO queue in virtual time: `after(t, cost)` is when an operation that
    arrives at `t` is done."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self.loop = loop
        self.name = name
        self.free_at = 0.0
        self.busy_s = 0.0
        self.ops = 0

    def after(self, arrive_at: float, cost: float) -> float:
        start = max(arrive_at, self.free_at)
        self.free_at = start + cost
        self.busy_s += cost
        self.ops += 1
        return self.free_at

    def backlog_s(self) -> float:
        return max(0.0, self.free_at - self.loop.time())


# --- subjects -------------------------------------------------------------------------------------


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` the rest."""
    ps, ss = pattern.split("."), subject.split(".")
    for i, token in enumerate(ps):
        if token == ">":
            return len(ss) > i
        if i >= len(ss) or (token != "*" and token != ss[i]):
            return False
    return len(ps) == len(ss)


def literal_prefix(pattern: str) -> str:
    """A wildcard subscription's tokens before its first wildcard (`_INBOX.abc.*` -> `_INBOX.abc`):
    the wildcard subscriptions are kept by it, so a message is matched only against those whose
    prefix is one of its subject's (`prefixes`), not against every connection's inbox."""
    tokens = []
    for token in pattern.split("."):
        if token in ("*", ">"):
            break
        tokens.append(token)
    return ".".join(tokens)


def prefixes(subject: str) -> list[str]:
    """Every leading run of a subject's tokens, the empty one first (`a.b` -> ``, `a`, `a.b`)."""
    tokens = subject.split(".")
    return [".".join(tokens[:i]) for i in range(len(tokens) + 1)]


@dataclass(eq=False)
class CoreMsg:
    subject: str
    data: bytes
    headers: dict[str, str] | None = None
    reply: str = ""
    _conn: Any = None

    async def respond(self, data: bytes) -> None:
        if self.reply and self._conn is not None:
            await self._conn.publish(self.reply, data)


@dataclass(eq=False)
class CoreSub:
    """A subscription: with a callback, each message runs it (a task); without, messages wait in
    `pending` for `next_msg` (nats-py's two kinds)."""

    conn: Connection
    subject: str
    queue: str
    cb: Callable[[CoreMsg], Any] | None
    wild: bool
    pending: collections.deque[Any] = field(default_factory=collections.deque)
    _waiter: asyncio.Future[None] | None = None

    @property
    def pending_msgs(self) -> int:
        return len(self.pending)

    def put(self, msg: Any) -> None:
        self.pending.append(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_msg(self, timeout: float | None = 1.0) -> Any:
        """The next message; nats.errors.TimeoutError when none came within `timeout`."""
        if not self.pending:
            self._waiter = self.conn.bus.loop.create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout)
            except asyncio.TimeoutError:
                raise nats.errors.TimeoutError() from None
        return self.pending.popleft()

    async def unsubscribe(self) -> None:
        self.conn.bus.unsubscribe(self)


# --- JetStream ------------------------------------------------------------------------------------


@dataclass(eq=False)
class Stored:
    """A message in a stream."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None
    stream: Stream
    consumer: Consumer | None = None
    num_delivered: int = 0
    ack_deadline: float = 0.0
    pending: bool = False  # delivered, not yet acked
    gone: bool = False  # acked, deleted or dead


@dataclass(eq=False)
class PullRequest:
    conn: Connection
    batch: int
    expires_at: float
    future: asyncio.Future[list[Any]] | None  # fetch's; None: answered to `inbox`
    inbox: CoreSub | None = None  # a raw pull request's reply subject ($JS.API.CONSUMER.MSG.NEXT)
    no_wait: bool = False  # answered at once: what is queued now, or 404
    msgs: list[JsMsg] = field(default_factory=list)
    ready_at: float = 0.0  # when the last delivery leaves the server
    timer: asyncio.TimerHandle | None = None
    done: bool = False


class JsMsg:
    """A delivered message, as nats-py's `Msg` of a pull subscription looks to shoal."""

    __slots__ = ("_conn", "_delivery", "_stored", "data", "headers", "metadata", "subject")

    def __init__(self, stored: Stored, conn: Connection) -> None:
        self._stored = stored
        self._conn = conn
        self._delivery = stored.num_delivered
        self.subject = stored.subject
        self.data = stored.data
        self.headers = stored.headers
        self.metadata = SimpleNamespace(num_delivered=stored.num_delivered, sequence=SimpleNamespace(stream=stored.seq))

    def _op(self, fn: Callable[..., None], *args: Any, kind: str = "ack") -> None:
        self._conn.check()
        self._conn.sent += 1
        bus = self._conn.bus
        bus.counts[kind] += 1
        consumer = self._stored.consumer
        server = consumer.server if consumer is not None else self._stored.stream.server
        at = server.after(bus.loop.time() + bus.costs.latency_s, bus.costs.ack_s)
        bus.loop.call_at(at, fn, self._stored, self._delivery, *args)

    async def ack(self) -> None:
        self._op(Consumer.on_ack)

    async def term(self) -> None:
        self._op(Consumer.on_ack)

    async def nak(self, delay: float | None = None) -> None:
        self._op(Consumer.on_nak, delay, kind="nak")

    async def in_progress(self) -> None:
        self._op(Consumer.on_progress, kind="progress")


class Stream:
    """A work-queue stream (or a partition of one) and the one server its operations queue on."""

    def __init__(self, bus: Bus, name: str) -> None:
        self.bus = bus
        self.name = name
        self.server = Server(bus.loop, name)
        self.consumers: dict[str, Consumer] = {}  # by filter subject
        self.wildcard: list[Consumer] = []
        self.unclaimed: list[Stored] = []  # stored before any consumer filtered them

    def consumer_of(self, subject: str) -> Consumer | None:
        found = self.consumers.get(subject)
        if found is None:
            found = next((c for c in self.wildcard if matches(c.filter, subject)), None)
        return found

    def store(self, subject: str, data: bytes, headers: dict[str, str] | None) -> Stored:
        stored = Stored(self.bus.next_seq(), subject, data, headers, self)
        self.bus.messages[stored.seq] = stored
        consumer = self.consumer_of(subject)
        if consumer is None:
            self.unclaimed.append(stored)
        else:
            consumer.add(stored)
        return stored


class Consumer:
    """A durable pull consumer (explicit ack) on one filter subject (see the module docstring)."""

    def __init__(self, stream: Stream, name: str, filter_subject: str, config: Any) -> None:
        self.stream = stream
        self.bus = stream.bus
        self.name = name
        self.server = Server(stream.bus.loop, name)
        self.filter = filter_subject
        self.config = config
        self.ack_wait_s = float(config.ack_wait or 30.0)
        self.max_deliver = int(config.max_deliver or -1)
        self.max_waiting = int(config.max_waiting or 512)
        self.new: collections.deque[Stored] = collections.deque()  # never delivered, in stream order
        self.again: collections.deque[Stored] = collections.deque()  # to redeliver: before new ones
        self.waiting: collections.deque[PullRequest] = collections.deque()
        self.num_pending = 0  # stored and not delivered
        self.num_ack_pending = 0
        self.num_delivered = 0  # deliveries so far (the consumer sequence)
        self.refused_s = 0.0  # of its server's time: pull requests refused past max_waiting
        # Handed back (nak) or past ack_wait, not yet delivered again: nats-server keeps them among
        # the ack-pending ones (num_ack_pending), not the pending ones (num_pending: never delivered).
        self.to_redeliver: set[int] = set()

    def add(self, stored: Stored) -> None:
        stored.consumer = self
        self.new.append(stored)
        self.num_pending += 1
        self.dispatch()

    # pull requests -------------------------------------------------------------------------------

    def on_pull(self, request: PullRequest) -> None:
        if request.conn.closed:
            return
        if len(self.waiting) >= self.max_waiting:
            self.bus.counts["409"] += 1
            self.server.after(self.bus.loop.time(), self.bus.costs.status_s)
            self.refused_s += self.bus.costs.fetch_s + self.bus.costs.status_s
            self._end(request, nats.errors.TimeoutError())  # nats-py's fetch: 409 Exceeded MaxWaiting
            return
        if request.no_wait:
            self.waiting.appendleft(request)  # nothing waits while calls are queued: it is served now
            self.dispatch()
            if not request.done:
                self.waiting.popleft()
                self.bus.counts["404" if not request.msgs else "partial"] += 1
                request.ready_at = self.server.after(self.bus.loop.time(), self.bus.costs.status_s)
                self._end(request, None if request.msgs else nats.errors.TimeoutError(), "404")
            return
        self.waiting.append(request)
        request.timer = self.bus.loop.call_at(request.expires_at, self._expire, request)
        self.dispatch()

    def _expire(self, request: PullRequest) -> None:
        if request.done:
            return
        with contextlib.suppress(ValueError):
            self.waiting.remove(request)
        request.ready_at = self.server.after(self.bus.loop.time(), self.bus.costs.status_s)
        self._end(request, None if request.msgs else nats.errors.TimeoutError())

    def _end(self, request: PullRequest, error: BaseException | None, status: str = "408") -> None:
        """The request's answer leaves the server: its messages, or a status that fetch raises as
        `error` (a raw request's inbox gets the status message itself)."""
        request.done = True
        if request.timer is not None:
            request.timer.cancel()
        bus = self.bus
        arrive = max(bus.loop.time(), request.ready_at) + bus.costs.latency_s
        if error is None:
            arrive = request.conn.cpu_after(arrive, request.conn.costs.pulled_s * len(request.msgs))
        else:
            bus.counts["status"] += 1
        request.conn.received += len(request.msgs) if error is None else 1
        if request.inbox is not None:
            answer = request.msgs if error is None else [CoreMsg(request.inbox.subject, b"", {"Status": status})]
            bus.loop.call_at(arrive, _to_inbox, request.inbox, answer)
        elif request.future is not None:
            bus.loop.call_at(arrive, _settle, request.future, request.msgs, error)

    def _next(self) -> Stored | None:
        for queue in (self.again, self.new):
            while queue:
                stored = queue.popleft()
                if queue is self.new:
                    self.num_pending -= 1
                if not stored.gone and not stored.pending:
                    return stored
        return None

    def dispatch(self) -> None:
        """Hands available messages to the waiting requests, the oldest request first."""
        bus = self.bus
        while self.waiting and (self.again or self.new):
            request = self.waiting[0]
            if request.conn.closed:
                self.waiting.popleft()
                request.done = True
                continue
            stored = self._next()
            if stored is None:
                break
            now = bus.loop.time()
            stored.num_delivered += 1
            self.num_delivered += 1
            self.to_redeliver.discard(stored.seq)
            stored.pending = True
            stored.ack_deadline = now + self.ack_wait_s
            self.num_ack_pending += 1
            bus.loop.call_at(stored.ack_deadline, self._ack_timer, stored, stored.num_delivered)
            bus.counts["deliver"] += 1
            request.msgs.append(JsMsg(stored, request.conn))
            request.ready_at = self.server.after(now, bus.costs.deliver_s)
            if len(request.msgs) >= request.batch:
                self.waiting.popleft()
                self._end(request, None)

    # acks ----------------------------------------------------------------------------------------

    def _settle_pending(self, stored: Stored) -> bool:
        if not stored.pending:
            return False
        stored.pending = False
        self.num_ack_pending -= 1
        return True

    @staticmethod
    def on_ack(stored: Stored, delivery: int) -> None:
        consumer = stored.consumer
        if consumer is not None:
            consumer._settle_pending(stored)
            consumer.to_redeliver.discard(stored.seq)
        stored.gone = True
        stored.stream.bus.messages.pop(stored.seq, None)

    @staticmethod
    def on_progress(stored: Stored, delivery: int) -> None:
        consumer = stored.consumer
        if consumer is not None and stored.pending and stored.num_delivered == delivery:
            stored.ack_deadline = consumer.bus.loop.time() + consumer.ack_wait_s

    @staticmethod
    def on_nak(stored: Stored, delivery: int, delay: float | None) -> None:
        consumer = stored.consumer
        if consumer is None or stored.num_delivered != delivery or not consumer._settle_pending(stored):
            return
        if consumer._dead(stored):
            return
        consumer.to_redeliver.add(stored.seq)
        if delay:
            consumer.bus.loop.call_later(delay, consumer._again, stored)
        else:
            consumer._again(stored)

    def _again(self, stored: Stored) -> None:
        if not stored.gone and not stored.pending:
            self.again.append(stored)
            self.dispatch()

    def _ack_timer(self, stored: Stored, delivery: int) -> None:
        if not stored.pending or stored.num_delivered != delivery or stored.gone:
            return
        now = self.bus.loop.time()
        if now < stored.ack_deadline:  # in_progress() moved it
            self.bus.loop.call_at(stored.ack_deadline, self._ack_timer, stored, delivery)
            return
        self._settle_pending(stored)
        self.bus.counts["redelivered"] += 1
        if not self._dead(stored):
            self.to_redeliver.add(stored.seq)
            self._again(stored)

    def _dead(self, stored: Stored) -> bool:
        """Delivered max_deliver times: JetStream's max-deliveries advisory goes out, the message
        stays in the stream, delivered no more."""
        if self.max_deliver <= 0 or stored.num_delivered < self.max_deliver:
            return False
        self.bus.counts["dead"] += 1
        advisory = json.dumps({"stream_seq": stored.seq, "deliveries": stored.num_delivered}).encode()
        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.stream.name}.{self.name}"
        dead = self.bus.stream_of(subject)
        if dead is not None:
            dead.store(subject, advisory, None)
        return True

    def info(self) -> Any:
        return SimpleNamespace(
            name=self.name,
            stream_name=self.stream.name,
            config=self.config,
            num_pending=self.num_pending,
            num_ack_pending=self.num_ack_pending + len(self.to_redeliver),
            num_waiting=len(self.waiting),
            delivered=SimpleNamespace(consumer_seq=self.num_delivered, stream_seq=0),
        )


def _to_inbox(inbox: CoreSub, msgs: list[Any]) -> None:
    if not inbox.conn.closed:
        for msg in msgs:
            inbox.put(msg)


def _settle(future: asyncio.Future[Any], msgs: list[Any], error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(msgs)


class PullSubscription:
    def __init__(self, conn: Connection, consumer: Consumer) -> None:
        self.conn = conn
        self.consumer = consumer

    @property
    def pending_msgs(self) -> int:
        """As nats-py's: deliveries in the client's buffer that no fetch has read. None here: a
        fetch's deliveries are handed to it whole, never left behind after its wait."""
        return 0

    async def fetch(self, batch: int = 1, timeout: float | None = 5.0, heartbeat: float | None = None) -> list[Any]:
        """As nats-py's: fetch(1) waits for one message; fetch(n) takes what comes until n or the
        timeout (nats-server holds a request with `expires` until then). Raises
        nats.errors.TimeoutError when nothing came."""
        self.conn.check()
        bus = self.conn.bus
        loop = bus.loop
        timeout = 5.0 if timeout is None else timeout
        bus.counts["fetch"] += 1
        self.conn.sent += 1
        arrive = self.consumer.server.after(loop.time() + bus.costs.latency_s, bus.costs.fetch_s)
        request = PullRequest(self.conn, batch, arrive + timeout, loop.create_future())
        loop.call_at(arrive, self.consumer.on_pull, request)
        return await request.future

    async def unsubscribe(self) -> None:
        pass


class JetStream:
    """What `nc.jetstream()` gives shoal: streams, consumers, publish, pull subscriptions."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.bus = conn.bus

    async def _api(self) -> None:
        """A JetStream API request's round trip, through the server's one API queue."""
        self.conn.check()
        bus = self.bus
        bus.counts["api"] += 1
        self.conn.sent += 1
        self.conn.received += 1
        now = bus.loop.time()
        done = bus.api.after(now + bus.costs.latency_s, bus.costs.api_s) + bus.costs.latency_s
        await asyncio.sleep(done - now)

    async def add_stream(self, config: Any = None, **params: Any) -> Any:
        await self._api()
        return SimpleNamespace(config=config)

    async def update_stream(self, config: Any = None, **params: Any) -> Any:
        await self._api()
        return SimpleNamespace(config=config)

    async def stream_info(self, name: str) -> Any:
        await self._api()
        ttl = self.bus.bucket_ttl_s
        return SimpleNamespace(config=SimpleNamespace(max_age=ttl, duplicate_window=ttl, evolve=lambda **kw: None))

    async def object_store(self, bucket: str) -> Any:
        await self._api()
        if self.bus.bucket_ttl_s is None:
            raise nats.js.errors.BucketNotFoundError()
        return _NoStore()

    async def create_object_store(self, bucket: str, config: Any = None) -> Any:
        await self._api()
        self.bus.bucket_ttl_s = getattr(config, "ttl", None) or 3600.0
        return _NoStore()

    async def add_consumer(self, stream: str, config: Any = None, **params: Any) -> Any:
        await self._api()
        return self.bus.add_consumer(config.durable_name, config.filter_subject, config).info()

    async def consumer_info(self, stream: str, consumer: str) -> Any:
        await self._api()
        return self.bus.consumer(consumer).info()

    async def consumers_info(self, stream: str, offset: int | None = None) -> list[Any]:
        await self._api()
        found = [c.info() for c in self.bus.consumers.values() if c.stream.name != self.bus.dead_name]
        return found[offset or 0 : (offset or 0) + 256]

    async def pull_subscribe_bind(self, durable: str, stream: str, **params: Any) -> PullSubscription:
        await self._api()
        return PullSubscription(self.conn, self.bus.consumer(durable))

    async def pull_subscribe(self, subject: str, durable: str, stream: str | None = None, **params: Any) -> Any:
        await self._api()
        consumer = self.bus.consumers.get(durable)
        if consumer is None:
            config = SimpleNamespace(ack_wait=30.0, max_deliver=-1, max_waiting=512, durable_name=durable)
            consumer = self.bus.add_consumer(durable, subject, config)
        return PullSubscription(self.conn, consumer)

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Stored once the stream's server gets to it; the PubAck comes back a hop later. A repeat
        of a Nats-Msg-Id in the duplicate window is acked with the first copy's sequence."""
        self.conn.check()
        bus, loop = self.bus, self.bus.loop
        target = bus.stream_of(subject)
        if target is None:
            raise nats.errors.NoRespondersError()
        bus.counts["publish"] += 1
        self.conn.sent += 1
        self.conn.received += 1  # its PubAck
        sent = self.conn.cpu_after(loop.time(), self.conn.costs.publish_s)
        stored_at = target.server.after(sent + bus.costs.latency_s, bus.costs.publish_s)
        future: asyncio.Future[Any] = loop.create_future()
        loop.call_at(stored_at, bus.store, target, subject, payload, headers, future)
        return await asyncio.wait_for(future, timeout or 5.0)

    async def get_msg(self, stream_name: str, seq: int, **params: Any) -> Any:
        await self._api()
        stored = self.bus.messages.get(seq)
        if stored is None:
            raise nats.js.errors.NotFoundError(code=404, err_code=10037, description="no message found")
        return SimpleNamespace(subject=stored.subject, seq=seq, data=stored.data, headers=stored.headers)

    async def delete_msg(self, stream_name: str, seq: int) -> bool:
        await self._api()
        stored = self.bus.messages.pop(seq, None)
        if stored is None:
            raise nats.js.errors.NotFoundError(code=404, err_code=10037, description="no message found")
        stored.gone = True
        if stored.consumer is not None:
            stored.consumer._settle_pending(stored)
            stored.consumer.to_redeliver.discard(seq)
        return True


class _NoStore:
    """The payload bucket: the simulated calls and results are small, so it is never used."""

    async def put(self, name: str, data: bytes) -> None:
        raise nats.js.errors.ServiceUnavailableError()

    async def get(self, name: str, writeinto: Any = None) -> None:
        raise nats.js.errors.ObjectNotFoundError()

    async def delete(self, name: str) -> None:
        raise nats.js.errors.ObjectNotFoundError()


# --- the server and its clients -----------------------------------------------------------------


class Connection:
    """A client's connection, as much of nats-py's `Client` as shoal uses."""

    def __init__(self, bus: Bus, name: str, costs: ClientCosts, cpu: Server | None) -> None:
        self.bus = bus
        self.name = name
        self.costs = costs
        self.cpu = cpu
        self.closed = False
        self.max_payload = MAX_PAYLOAD
        self.subs: list[CoreSub] = []
        self.sent = 0  # messages this client sent and received (what its event loop handled)
        self.received = 0

    @property
    def is_connected(self) -> bool:
        return not self.closed

    def check(self) -> None:
        if self.closed:
            raise nats.errors.ConnectionClosedError()

    def cpu_after(self, at: float, cost: float) -> float:
        return self.cpu.after(at, cost) if self.cpu is not None and cost else at

    def jetstream(self, **params: Any) -> JetStream:
        return JetStream(self)

    def new_inbox(self) -> str:
        self.bus.inboxes += 1
        return f"_INBOX.sim.{self.bus.inboxes}"

    async def subscribe(self, subject: str, queue: str = "", cb: Any = None, **params: Any) -> CoreSub:
        self.check()
        sub = CoreSub(self, subject, queue, cb, "*" in subject or ">" in subject)
        self.bus.subscribe(sub)
        return sub

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "", headers: Any = None) -> None:
        self.check()
        self.sent += 1
        self.bus.route(self, CoreMsg(subject, payload, headers, reply))

    async def flush(self, timeout: float = 10.0) -> None:
        self.check()
        await asyncio.sleep(2 * self.bus.costs.latency_s)

    async def close(self) -> None:
        self.kill()

    async def drain(self) -> None:
        self.kill()

    def kill(self) -> None:
        """Gone at once (a crash): its subscriptions end; what it was delivered and did not ack is
        redelivered after ack_wait."""
        if self.closed:
            return
        self.closed = True
        for sub in list(self.subs):
            self.bus.unsubscribe(sub)


class Bus:
    """The simulated nats-server (see the module docstring). `partition(subject)` names the work
    stream a subject's calls go to: one name for shoal's one stream."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        costs: BusCosts,
        *,
        work_prefix: str = "shoal.work.",
        dead_subject: str = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.",
        dead_name: str = "SHOAL_DEAD",
        partition: Callable[[str], str] = lambda subject: "SHOAL_WORK",
    ) -> None:
        self.loop = loop
        self.costs = costs
        self.work_prefix = work_prefix
        self.dead_subject = dead_subject
        self.dead_name = dead_name
        self.partition = partition
        self.streams: dict[str, Stream] = {}
        self.consumers: dict[str, Consumer] = {}
        self.messages: dict[int, Stored] = {}  # every stored message, by its sequence (one space for all)
        self._seq = itertools.count(1)
        self.exact: dict[str, list[CoreSub]] = collections.defaultdict(list)
        self.wild: dict[str, list[CoreSub]] = collections.defaultdict(list)  # by literal_prefix
        self._rotate = itertools.count()
        self.counts: collections.Counter[str] = collections.Counter()
        self.bucket_ttl_s: float | None = None
        self.connections: list[Connection] = []
        self.inboxes = 0
        self.api = Server(loop, "$JS.API")  # nats-server answers JetStream API requests in turn
        # Subscription callbacks in flight (held here: the loop holds tasks weakly).
        self.callbacks: set[asyncio.Task[Any]] = set()
        self._ids: dict[str, int] = {}  # Nats-Msg-Id -> sequence, within the duplicate window
        self._id_times: collections.deque[tuple[float, str]] = collections.deque()

    def message_count(self) -> int:
        """Messages into and out of the server so far (a publish and its PubAck are two)."""
        c = self.counts
        return (
            2 * (c["publish"] + c["api"])
            + c["fetch"]
            + c["status"]
            + c["deliver"]
            + c["ack"]
            + c["nak"]
            + c["progress"]
            + c["core_in"]
            + c["core_out"]
        )

    def cpu_s(self) -> float:
        """The server's CPU so far: its streams' and consumers' queues, and core routing."""
        servers = [s.server for s in self.streams.values()] + [c.server for c in self.consumers.values()] + [self.api]
        return sum(s.busy_s for s in servers) + self.costs.core_s * (self.counts["core_in"] + self.counts["core_out"])

    def next_seq(self) -> int:
        return next(self._seq)

    def connect(self, name: str, costs: ClientCosts, cpu: Server | None = None) -> Connection:
        conn = Connection(self, name, costs, cpu)
        self.connections.append(conn)
        return conn

    # core --------------------------------------------------------------------------------------

    def subscribe(self, sub: CoreSub) -> None:
        (self.wild[literal_prefix(sub.subject)] if sub.wild else self.exact[sub.subject]).append(sub)
        sub.conn.subs.append(sub)

    def unsubscribe(self, sub: CoreSub) -> None:
        with contextlib.suppress(ValueError):
            (self.wild[literal_prefix(sub.subject)] if sub.wild else self.exact[sub.subject]).remove(sub)
        with contextlib.suppress(ValueError):
            sub.conn.subs.remove(sub)

    def route(self, sender: Connection, msg: CoreMsg) -> None:
        """A core message to every matching subscription (one per queue group), a hop each way; a
        pull request to JetStream's API (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`) to its
        consumer."""
        if msg.subject.startswith(PULL_API):
            self._raw_pull(sender, msg)
            return
        subs = self.exact.get(msg.subject, []) + [
            s for prefix in prefixes(msg.subject) for s in self.wild.get(prefix, ()) if matches(s.subject, msg.subject)
        ]
        groups: dict[str, list[CoreSub]] = {}
        chosen = []
        for sub in subs:
            if sub.queue:
                groups.setdefault(sub.queue, []).append(sub)
            else:
                chosen.append(sub)
        for members in groups.values():
            chosen.append(members[next(self._rotate) % len(members)])
        self.counts["core_in"] += 1
        self.counts["core_out"] += len(chosen)
        at = self.loop.time() + 2 * self.costs.latency_s
        heartbeat = msg.subject.startswith("shoal.hb.")
        for sub in chosen:
            conn = sub.conn
            cost = conn.costs.heartbeat_s if heartbeat else conn.costs.receive_s
            self.loop.call_at(conn.cpu_after(at, cost), _deliver_core, sub, msg)

    def _raw_pull(self, sender: Connection, msg: CoreMsg) -> None:
        """A pull request sent as a message: its answer goes to the message's reply subject."""
        consumer = self.consumers.get(msg.subject.rsplit(".", 1)[-1])
        inbox = next((s for s in self.exact.get(msg.reply, []) if s.conn is sender), None)
        if consumer is None or inbox is None:
            return
        body = json.loads(msg.data or b"{}")
        self.counts["fetch"] += 1
        self.counts["raw_pull"] += 1
        arrive = consumer.server.after(self.loop.time() + self.costs.latency_s, self.costs.fetch_s)
        expires_s = body.get("expires", 0) / 1e9 or 5.0
        request = PullRequest(
            sender, int(body.get("batch", 1)), arrive + expires_s, None, inbox, bool(body.get("no_wait"))
        )
        self.loop.call_at(arrive, consumer.on_pull, request)

    # JetStream ---------------------------------------------------------------------------------

    def stream_of(self, subject: str) -> Stream | None:
        if subject.startswith(self.work_prefix):
            name = self.partition(subject)
        elif subject.startswith(self.dead_subject):
            name = self.dead_name
        else:
            return None
        if name not in self.streams:
            self.streams[name] = Stream(self, name)
        return self.streams[name]

    def add_consumer(self, name: str, filter_subject: str, config: Any) -> Consumer:
        if name in self.consumers:
            return self.consumers[name]
        stream = self.stream_of(filter_subject.replace("*", "x").replace(">", "x"))
        if stream is None:
            raise nats.js.errors.NotFoundError(code=404, description=f"no stream for {filter_subject}")
        consumer = Consumer(stream, name, filter_subject, config)
        self.consumers[name] = consumer
        if "*" in filter_subject or ">" in filter_subject:
            stream.wildcard.append(consumer)
        else:
            stream.consumers[filter_subject] = consumer
        for stored in [s for s in stream.unclaimed if matches(filter_subject, s.subject)]:
            stream.unclaimed.remove(stored)
            consumer.add(stored)
        return consumer

    def consumer(self, name: str) -> Consumer:
        if name not in self.consumers:
            raise nats.js.errors.NotFoundError(code=404, err_code=10014, description="consumer not found")
        return self.consumers[name]

    def store(
        self, stream: Stream, subject: str, data: bytes, headers: dict[str, str] | None, future: asyncio.Future[Any]
    ) -> None:
        now = self.loop.time()
        while self._id_times and self._id_times[0][0] < now - DUPLICATE_WINDOW_S:
            self._ids.pop(self._id_times.popleft()[1], None)
        msg_id = (headers or {}).get("Nats-Msg-Id")
        if msg_id and msg_id in self._ids:
            seq, duplicate = self._ids[msg_id], True
        else:
            seq, duplicate = stream.store(subject, data, headers).seq, False
            if msg_id:
                self._ids[msg_id] = seq
                self._id_times.append((now, msg_id))
        ack = SimpleNamespace(stream=stream.name, seq=seq, duplicate=duplicate)
        self.loop.call_at(self.loop.time() + self.costs.latency_s, _settle, future, ack, None)


def _deliver_core(sub: CoreSub, msg: CoreMsg) -> None:
    if sub.conn.closed:
        return
    sub.conn.received += 1
    if sub.cb is None:
        sub.put(CoreMsg(msg.subject, msg.data, msg.headers, msg.reply, sub.conn))
        return
    result = sub.cb(CoreMsg(msg.subject, msg.data, msg.headers, msg.reply, sub.conn))
    if asyncio.iscoroutine(result):
        running = sub.conn.bus.callbacks
        task = asyncio.get_running_loop().create_task(result)
        running.add(task)
        task.add_done_callback(running.discard)
