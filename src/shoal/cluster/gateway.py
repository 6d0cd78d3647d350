"""`RemoteService`: the `Service` a cluster gateway serves its HTTP routes over (torch-free).

The gateway reads only a call's envelope: it resolves the model (an alias to its id; a typo is a
404 from the catalog), picks a pool whose live workers serve it, and publishes the call, with a
request id, a deadline and a token estimate in its headers, to `shoal.work.<pool>.<model>` on the
JetStream work queue. It then awaits the worker's reply on its own inbox:

    run(call) ─ resolve ─ no live worker? ─────────────── 503 no_worker + Retry-After, demand gauge
              │                NATS down? ─────────────── 503 queue_unavailable
              ├ larger than the message limit: body to the Object Store, the message names it
              ├ publish (JetStream acks it: stored) ───── no ack in publish_timeout_s: 503
              ├ await the reply (result, or an error result) until the deadline (+ a grace)
              └ finally, unanswered (deadline, client gone): delete the message from the stream
                (not yet delivered: never computed) and broadcast the request id on shoal.cancel
                (delivered: the worker drops it); the call's object is deleted in every case

Dead letters: JetStream publishes an advisory when a call has been delivered `max_deliver` times;
the SHOAL_DEAD stream keeps those, and every gateway pulls from one shared durable consumer: it
reads the call's headers from the work stream, answers its caller (on whichever gateway that is)
with a 502 `dead_letter` naming the request id, and deletes the call.

Heartbeats arrive on core NATS (`shoal.hb.<worker>`): a worker silent for `worker_ttl_s`, or
draining, serves nothing. Core subscriptions come back by themselves after a reconnect, and a
gateway asks for every heartbeat at once (`shoal.ping`) when it (re)connects.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from typing import Any

import msgspec
from prometheus_client import Counter, Gauge

from .. import calls
from ..calls import AnyCall, AnyResult, ErrorResult, timeout_of
from ..catalog import Catalog
from ..config import Settings
from ..errors import DeadLetter, DeadlineExceeded, NoWorker, QueueUnavailable, UnknownModel
from ..metrics import Metrics
from ..service import Capacity, CardProblem, ModelStatus, Token, status_of_card
from . import protocol as p

log = logging.getLogger("shoal.gateway")

# How long past a call's deadline the gateway still waits for a reply it may be computing.
_REPLY_GRACE_S = 2.0
# The demand gauge counts unserved requests over this window.
_DEMAND_WINDOW_S = 60.0
# How often the queue gauges are read from JetStream (one consumer-list request).
_QUEUE_POLL_S = 5.0


class GatewayMetrics:
    def __init__(self, registry) -> None:
        r = registry
        self.inflight = Gauge("shoal_gateway_inflight_calls", "Calls published and not yet answered", ["model"],
                              registry=r)
        self.published = Counter("shoal_gateway_published_calls", "Calls published to the work queue", ["model", "pool"],
                                 registry=r)
        self.demand = Gauge("shoal_gateway_demand", "Requests in the last minute for a model no live worker serves "
                            "(what scales a pool up from zero)", ["model"], registry=r)
        self.unserved = Counter("shoal_gateway_unserved_requests", "Requests refused because no live worker serves "
                                "the model", ["model"], registry=r)
        self.dead_letters = Counter("shoal_dead_letters", "Calls delivered max_deliver times without an answer",
                                    ["model"], registry=r)
        self.objects = Counter("shoal_gateway_object_payloads", "Calls (sent) and results (received) that went through "
                               "the Object Store", ["direction"], registry=r)
        self.workers = Gauge("shoal_gateway_workers", "Live workers, by pool", ["pool"], registry=r)
        self.connected = Gauge("shoal_gateway_nats_connected", "1 while the gateway is connected to NATS", registry=r)
        # The queue, as JetStream sees it (read every _QUEUE_POLL_S): what KEDA's nats-jetstream
        # trigger scales on, here for dashboards and the lag alert.
        self.queue_pending = Gauge("shoal_queue_pending_calls", "Calls in the work queue not yet delivered to a worker",
                                   ["pool", "model"], registry=r)
        self.queue_unacked = Gauge("shoal_queue_unacked_calls", "Calls delivered to a worker and not yet acked "
                                   "(running, or held on its host)", ["pool", "model"], registry=r)
        self.abandoned = Counter("shoal_gateway_abandoned_calls", "Calls given up before their reply (deadline "
                                 "or client gone): deleted from the queue or cancelled on their worker",
                                 ["model", "reason"], registry=r)
        for direction in ("call", "result"):  # at 0 from the first scrape: rate() sees the first one
            self.objects.labels(direction)

    def start_models(self, model_ids) -> None:
        """Series at 0 for the catalog's models (see `Metrics.start_models`): the dead-letter alert
        sees the first one, and a pool's wake-up query (`shoal_gateway_demand`) reads 0, not nothing."""
        for model in model_ids:
            self.dead_letters.labels(model)
            self.unserved.labels(model)
            self.inflight.labels(model).set(0)
            self.demand.labels(model).set(0)
            for reason in ("deadline", "cancelled"):
                self.abandoned.labels(model, reason)


class RemoteService:
    """Serves calls by the cluster's workers (see the module docstring)."""

    def __init__(self, settings: Settings, catalog: Catalog, *, metrics: Metrics | None = None,
                 consumers: tuple[tuple[str, str], ...] = ()) -> None:
        self.settings = settings
        # (pool, model) consumers made at setup, before any worker of the pool runs: a pool scaled
        # to zero has its consumers, so KEDA's nats-jetstream trigger reads their lag (of a missing
        # consumer it reads the whole stream's) and the queue gauges show them.
        self.consumers = consumers
        self.cluster = settings.cluster
        self.catalog = catalog
        self.metrics = metrics or Metrics()
        self.gm = GatewayMetrics(self.metrics.registry)
        self.gm.start_models(card.id for card in catalog)
        self.id = f"gw-{uuid.uuid4().hex[:12]}"
        self._inbox = f"_INBOX.shoal.{self.id}"
        self._pending: dict[str, asyncio.Future] = {}  # call key -> its reply
        self._sequences: dict[str, int] = {}  # call key -> its stream sequence, once stored
        self._background: set[asyncio.Task] = set()
        self._workers: dict[str, tuple[float, p.Heartbeat]] = {}  # id -> (monotonic time received, heartbeat)
        self._demand: dict[str, collections.deque] = {}
        self._served_cache: tuple[float, dict] | None = None
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None
        self._tasks: list[asyncio.Task] = []
        self._queue_ready = False
        self._started = False
        self._stopping = False

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Returns at once: the connection is made (and remade) in the background, so a gateway
        starts, and answers 503, while NATS is down."""
        self._started = True
        self._tasks.append(asyncio.create_task(self._connect(), name="gateway-connect"))
        self._tasks.append(asyncio.create_task(self._tick(), name="gateway-tick"))

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(QueueUnavailable("the gateway is shutting down; retry", retry_after_s=1.0))
        # Let the failed calls' clean-up (delete from the queue, cancel on their workers) go out first.
        await asyncio.sleep(0)
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        if self._nc is not None:
            await self._nc.close()

    async def warm(self, model_ids: list[str]) -> None:
        """Workers load their own models (`shoal worker --preload`); a gateway holds none."""

    @property
    def ready(self) -> bool:
        return self._started and not self._stopping and self._connected()

    def _connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected and self._queue_ready

    async def _connect(self) -> None:
        nc = await p.connect(self.cluster.nats_url, f"shoal-gateway {self.id}",
                             on_disconnect=self._on_disconnect, on_reconnect=self._on_reconnect,
                             quiet=lambda: self._stopping)
        self._nc, self._js = nc, nc.jetstream()
        await nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        await nc.subscribe(f"{p.HEARTBEAT_PREFIX}.>", cb=self._on_heartbeat)
        await self._setup()
        self._tasks.append(asyncio.create_task(self._read_dead_letters(), name="gateway-dead-letters"))
        self._tasks.append(asyncio.create_task(self._watch_queue(), name="gateway-queue-gauges"))

    async def _setup(self) -> None:
        """Streams and bucket (a NATS that lost its store gets them back), then every heartbeat."""
        while not self._stopping:
            try:
                await p.ensure_queue(self._js, self.cluster)
                self._store = await self._js.object_store(p.PAYLOADS)
                await self._ensure_consumers()
                self._queue_ready = True
                self.gm.connected.set(1)
                await self._nc.publish(p.PING_SUBJECT, b"")
                return
            except Exception as exc:  # noqa: BLE001 (NATS not up yet, JetStream starting)
                log.warning("gateway: cannot set up the work queue yet (%s); retrying", exc)
                await asyncio.sleep(0.5)

    async def _ensure_consumers(self) -> None:
        from nats.js.errors import BadRequestError

        for pool, model_id in self.consumers:
            try:
                await p.ensure_consumer(self._js, self.cluster, pool, model_id)
            except BadRequestError as exc:  # made by a worker with other settings: it stays as it is
                log.warning("gateway: consumer of pool %s for %s exists with another configuration (%s)",
                            pool, model_id, exc)

    async def _on_disconnect(self) -> None:
        self._queue_ready = False
        self.gm.connected.set(0)

    async def _on_reconnect(self) -> None:
        async def setup_then_recheck() -> None:
            await self._setup()
            await self._recheck_pending()

        self._spawn(setup_then_recheck())

    async def _recheck_pending(self) -> None:
        """Replies travel on core NATS: one sent while this gateway was cut off is lost. A call no
        longer in the stream (acked: answered) whose reply has not come is failed now, retryably,
        instead of waiting out its deadline; calls still in the stream are still to be answered."""
        from nats.js.errors import NotFoundError

        await asyncio.sleep(0.5)  # replies sent just before the acks we are about to miss arrive first
        for key, seq in list(self._sequences.items()):
            future = self._pending.get(key)
            for attempt in range(5):
                if future is None or future.done() or self._stopping:
                    break
                try:
                    await self._js.get_msg(p.STREAM, seq)
                    break  # still in the stream: still to be answered
                except NotFoundError as exc:
                    if getattr(exc, "err_code", None) != 10037:  # not "no message found" (the stream itself?)
                        await asyncio.sleep(0.5 * (attempt + 1))
                        continue
                    if not future.done():
                        future.set_exception(QueueUnavailable(
                            "the gateway lost its connection to NATS while the call ran, and its answer with it; "
                            "retry", retry_after_s=1.0))
                    break
                except Exception:  # noqa: BLE001 (JetStream still starting: try again shortly)
                    await asyncio.sleep(0.5 * (attempt + 1))

    async def _tick(self) -> None:
        """Keeps the gauges true: live workers per pool, demand over the last minute."""
        while True:
            await asyncio.sleep(1.0)
            pools = collections.Counter(beat.pool for beat in self._live())
            for pool in {beat.pool for _, beat in self._workers.values()} | set(pools):
                self.gm.workers.labels(pool).set(pools.get(pool, 0))
            for model_id in list(self._demand):
                self._record_demand(model_id, add=False)

    async def _watch_queue(self) -> None:
        """The queue gauges, per consumer (pool and model): one series per consumer the workers made,
        dropped when its consumer goes."""
        shown: set[tuple[str, str]] = set()
        while True:
            if self._connected():
                try:
                    seen = set()
                    for info in await self._consumers():
                        labels = p.consumer_of(info.name)
                        if labels is None:
                            continue  # not one of shoal's
                        self.gm.queue_pending.labels(*labels).set(info.num_pending or 0)
                        self.gm.queue_unacked.labels(*labels).set(info.num_ack_pending or 0)
                        seen.add(labels)
                    for labels in shown - seen:
                        self.gm.queue_pending.remove(*labels)
                        self.gm.queue_unacked.remove(*labels)
                    shown = seen
                except Exception as exc:  # noqa: BLE001 (NATS away: the gauges keep their last values)
                    log.debug("gateway: cannot read the queue's consumers (%s)", exc)
            await asyncio.sleep(_QUEUE_POLL_S)

    async def _consumers(self) -> list:
        found: list = []
        while True:  # JetStream answers at most 256 per request
            page = await self._js.consumers_info(p.STREAM, offset=len(found) or None)
            found += page
            if len(page) < 256:
                return found

    # --- heartbeats -----------------------------------------------------------------------------

    async def _on_heartbeat(self, msg) -> None:
        try:
            beat = msgspec.msgpack.decode(msg.data, type=p.Heartbeat)
        except msgspec.DecodeError:
            log.warning("gateway: an undecodable heartbeat on %s", msg.subject)
            return
        previous = self._workers.get(beat.worker)
        self._workers[beat.worker] = (time.monotonic(), beat)
        if previous is None or previous[1].draining != beat.draining or previous[1].models != beat.models:
            self._served_cache = None  # a worker came, went or changed what it serves

    def _live(self) -> list[p.Heartbeat]:
        horizon = time.monotonic() - self.cluster.worker_ttl_s
        for worker, (seen, _) in list(self._workers.items()):
            if seen < horizon - 60.0:  # long gone: forget it
                del self._workers[worker]
        return [beat for seen, beat in self._workers.values() if seen >= horizon and not beat.draining]

    def _served(self) -> dict[str, list[tuple[p.Heartbeat, ModelStatus]]]:
        """Model id -> the live workers serving it, with each one's status of the model (rebuilt at
        most every 50 ms or on news from a worker: every request asks)."""
        now = time.monotonic()
        if self._served_cache is not None and now - self._served_cache[0] < 0.05:
            return self._served_cache[1]
        served: dict[str, list[tuple[p.Heartbeat, ModelStatus]]] = {}
        for beat in self._live():
            for status in beat.models:
                served.setdefault(status.id, []).append((beat, status))
        self._served_cache = (now, served)
        return served

    def _resolve(self, model_id: str, served: dict | None = None) -> str:
        """The served or catalogued model `model_id` names (an id or an alias); else UnknownModel."""
        served = self._served() if served is None else served
        if model_id in served:
            return model_id
        for mid, holders in served.items():
            if any(model_id in status.aliases for _, status in holders):
                return mid
        return self.catalog.get(model_id).id  # UnknownModel (with suggestions) for a typo

    def _holders(self, model_id: str) -> list[tuple[p.Heartbeat, ModelStatus]]:
        """The live workers serving the model; NoWorker (503, demand counted) when there are none."""
        if not self._connected():
            raise QueueUnavailable("the cluster's work queue (NATS) is unreachable from this gateway; retry shortly",
                                   retry_after_s=2.0)
        holders = self._served().get(model_id)
        if not holders:
            self.gm.unserved.labels(model_id).inc()
            self._record_demand(model_id, add=True)
            raise NoWorker(f"no worker serves {model_id} right now; retry shortly (a pool that scaled to zero is "
                           "being woken by this demand)", retry_after_s=max(2.0, self.cluster.worker_ttl_s),
                           details={"model": model_id})
        return holders

    def _record_demand(self, model_id: str, *, add: bool) -> None:
        times = self._demand.setdefault(model_id, collections.deque())
        now = time.monotonic()
        if add:
            times.append(now)
        while times and times[0] < now - _DEMAND_WINDOW_S:
            times.popleft()
        self.gm.demand.labels(model_id).set(len(times))

    @staticmethod
    def _pool_of(holders: list[tuple[p.Heartbeat, ModelStatus]]) -> str:
        """The pool with the most free capacity among the model's workers (most have one pool)."""
        free: dict[str, int] = collections.defaultdict(int)
        for beat, _ in holders:
            free[beat.pool] += beat.free_tokens + 1
        return max(free, key=free.__getitem__)

    # --- Service: statuses ----------------------------------------------------------------------

    def models(self) -> list[ModelStatus]:
        served = self._served()
        statuses = {mid: _merge(holders) for mid, holders in served.items()}
        for card in self.catalog:
            if card.id not in statuses:
                statuses[card.id] = status_of_card(card, state="no_worker", aliases=self.catalog.aliases_of(card.id))
        return sorted(statuses.values(), key=lambda s: s.id)

    def model(self, model_id: str) -> ModelStatus:
        served = self._served()
        mid = self._resolve(model_id, served)
        if mid in served:
            return _merge(served[mid])
        return status_of_card(self.catalog.get(mid), state="no_worker", aliases=self.catalog.aliases_of(mid))

    def has_model(self, model_id: str) -> bool:
        try:
            self._resolve(model_id)
        except UnknownModel:
            return False
        return True

    def problems(self) -> list[CardProblem]:
        seen = {problem.file: problem for beat in self._live() for problem in beat.problems}
        return sorted(seen.values(), key=lambda problem: problem.file)

    def capacity(self) -> Capacity:
        live = self._live()
        rates = [beat.tokens_per_s for beat in live if beat.tokens_per_s]
        return Capacity(sum(beat.inflight_tokens for beat in live),
                        sum(beat.inflight_tokens + beat.free_tokens for beat in live), sum(rates) if rates else None)

    # --- Service: calls -------------------------------------------------------------------------

    async def run(self, call: AnyCall) -> AnyResult:
        model_id = self._resolve(call.model)
        holders = self._holders(model_id)
        pool = self._pool_of(holders)
        timeout_s = timeout_of(call, self.settings.engine.request_timeout_s)
        deadline = time.monotonic() + timeout_s
        key = uuid.uuid4().hex
        request_id = call.request_id or key
        call = msgspec.structs.replace(call, model=model_id, request_id=request_id, timeout_s=timeout_s)
        data = calls.encode(call)
        headers = {p.REQUEST_ID: request_id, p.DEADLINE: f"{p.now() + timeout_s:.6f}",
                   p.TOKENS: str(p.estimate_tokens(call)), p.REPLY: f"{self._inbox}.{key}", p.MSG_ID: key}
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        inflight = self.gm.inflight.labels(model_id)
        inflight.inc()
        seq = None
        obj = None
        answered = False
        attempted = False
        reason = "deadline"
        try:
            if len(data) > self._nc.max_payload - self.cluster.payload_headroom_bytes:
                obj = f"call-{key}"
                try:
                    await asyncio.wait_for(self._store.put(obj, data), self._remaining(deadline))
                except asyncio.TimeoutError:
                    raise DeadlineExceeded("the request's deadline passed while its payload was stored",
                                           details={"phase": "queue", "request_id": request_id}) from None
                except Exception as exc:  # noqa: BLE001 (NATS gone mid-put)
                    raise QueueUnavailable(f"the payload store did not take the call ({type(exc).__name__}); "
                                           "retry shortly", retry_after_s=2.0,
                                           details={"request_id": request_id}) from None
                self.gm.objects.labels("call").inc()
                headers[p.OBJECT] = obj
                data = b""
            attempted = True
            seq = await self._publish(p.work_subject(pool, model_id), data, headers, deadline, request_id)
            self._sequences[key] = seq
            self.gm.published.labels(model_id, pool).inc()
            try:
                reply = await asyncio.wait_for(asyncio.shield(future), self._remaining(deadline) + _REPLY_GRACE_S)
            except asyncio.TimeoutError:
                raise DeadlineExceeded(
                    "the request's deadline passed before a worker answered (phase: queue); retry later or with "
                    "a longer timeout_s", details={"phase": "queue", "request_id": request_id}) from None
            answered = True
            result = await self._read_result(reply, deadline, request_id)
        except asyncio.CancelledError:
            reason = "cancelled"  # the client went away (the API cancels its handler)
            raise
        finally:
            self._pending.pop(key, None)
            self._sequences.pop(key, None)
            inflight.dec()
            if not answered and (seq is not None or attempted):
                # Also when the publish's ack was lost: the call may be stored, its worker drops it.
                self.gm.abandoned.labels(model_id, reason).inc()
                self._spawn(self._abandon(seq, key))
            if obj is not None:
                self._spawn(self._delete_object(obj))
        if isinstance(result, ErrorResult):
            error = result.error()
            error.details.setdefault("request_id", request_id)
            raise error
        return result

    async def _publish(self, subject: str, data: bytes, headers: dict, deadline: float, request_id: str) -> int:
        """The call's stream sequence once JetStream has stored it. A publish whose ack is lost is
        sent again with the same Nats-Msg-Id (the stream keeps one copy), while time is left."""
        for attempt in range(3):
            try:
                ack = await self._js.publish(subject, data, headers=headers,
                                             timeout=min(self.cluster.publish_timeout_s, self._remaining(deadline)))
                return ack.seq
            except Exception as exc:  # noqa: BLE001 (timeout, no responders, disconnected)
                error = exc
                if not self._connected() or self._remaining(deadline) < 0.05:
                    break
        raise QueueUnavailable(f"the work queue did not take the call ({type(error).__name__}); retry shortly",
                               retry_after_s=2.0, details={"request_id": request_id})

    @staticmethod
    def _remaining(deadline: float) -> float:
        return max(0.001, deadline - time.monotonic())

    def _spawn(self, coro) -> None:
        """A background task, referenced until done (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_reply(self, msg) -> None:
        key = msg.subject.rsplit(".", 1)[-1]
        future = self._pending.get(key)
        if future is not None and not future.done():
            future.set_result(msg)
        elif msg.headers and msg.headers.get(p.OBJECT):  # a second answer (a redelivery) or a late one
            await self._delete_object(msg.headers[p.OBJECT])

    async def _read_result(self, msg, deadline: float, request_id: str) -> AnyResult:
        data = msg.data
        name = msg.headers.get(p.OBJECT) if msg.headers else None
        try:
            if name:
                data = await asyncio.wait_for(p.read_object(self._store, name), self._remaining(deadline) + 5.0)
                self.gm.objects.labels("result").inc()
                self._spawn(self._delete_object(name))
            return calls.decode_result(data)
        except Exception as exc:  # noqa: BLE001 (object gone or NATS down mid-read; a corrupt reply)
            raise QueueUnavailable(f"the worker's answer could not be read ({type(exc).__name__}); retry",
                                   retry_after_s=1.0, details={"request_id": request_id}) from None

    async def _abandon(self, seq: int | None, key: str) -> None:
        """A call nobody waits for: out of the queue if no worker has it, dropped by the one that
        does (cancels name the gateway's unique key of the call, never the caller's request id)."""
        if seq is not None:
            try:
                await self._js.delete_msg(p.STREAM, seq)  # gone already once a worker acked it
            except Exception:  # noqa: BLE001
                pass
        try:
            await self._nc.publish(p.CANCEL_SUBJECT, key.encode())
        except Exception:  # noqa: BLE001 (NATS down: the worker finds the deadline passed instead)
            pass

    async def _delete_object(self, name: str) -> None:
        try:
            await self._store.delete(name)
        except Exception:  # noqa: BLE001 (deleted already, or NATS down: the bucket's TTL removes it)
            log.debug("gateway: object %s not deleted", name)

    # --- dead letters ---------------------------------------------------------------------------

    async def _read_dead_letters(self) -> None:
        """Pull max-deliveries advisories (shared by every gateway) and answer their callers."""
        from nats.errors import TimeoutError as NatsTimeout

        sub = None
        while not self._stopping:
            try:
                if sub is None:
                    sub = await self._js.pull_subscribe(p.DEAD_SUBJECT, durable="gateways", stream=p.DEAD_STREAM)
                for msg in await sub.fetch(16, timeout=1.0):
                    await self._dead_letter(msg)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (disconnected; stream being recreated)
                log.debug("gateway: dead letters: %s", exc)
                sub = None
                await asyncio.sleep(1.0)

    async def _dead_letter(self, advisory) -> None:
        from nats.js.errors import NotFoundError

        try:
            event = json.loads(advisory.data)
            seq = int(event["stream_seq"])
        except (ValueError, KeyError, TypeError):
            log.warning("gateway: an unreadable max-deliveries advisory: %r", advisory.data[:200])
            await advisory.ack()
            return
        try:
            stored = await self._js.get_msg(p.STREAM, seq)
        except NotFoundError:  # deleted already: its caller gave up, or another gateway answered it
            await advisory.ack()
            return
        # Any other failure (NATS busy, cut off): unacked, the advisory comes back to a gateway.
        headers = stored.headers or {}
        request_id = headers.get(p.REQUEST_ID, "?")
        model_id = p.untoken(stored.subject.rsplit(".", 1)[-1])
        deliveries = event.get("deliveries", self.cluster.max_deliver)
        log.error("dead letter: request %s for %s was delivered %s times without an answer", request_id, model_id,
                  deliveries)
        self.gm.dead_letters.labels(model_id).inc()
        error = DeadLetter(f"request {request_id} was delivered to workers {deliveries} times and none answered "
                           "(they died or ran past their time on it); it was not retried again",
                           details={"request_id": request_id, "deliveries": deliveries})
        if headers.get(p.REPLY):
            await self._nc.publish(headers[p.REPLY], calls.encode(ErrorResult.of(error, request_id)))
        try:
            await self._js.delete_msg(p.STREAM, seq)
        except Exception:  # noqa: BLE001
            pass
        await advisory.ack()

    # --- Service: control (over core NATS request/reply to the workers) --------------------------

    async def admin(self, model_id: str, action: str) -> ModelStatus:
        """The action on every live worker that serves the model; the merged status after it."""
        model_id = self._resolve(model_id)
        holders = self._holders(model_id)
        replies = await self._rpc_all("admin", model_id, p.RpcRequest(model=model_id, action=action), len(holders),
                                      {beat.pool for beat, _ in holders})
        statuses = [(None, reply.status) for reply in replies if reply.status is not None]
        errors = [reply.error for reply in replies if reply.error]
        if errors and not statuses:
            raise ErrorResult(**errors[0]).error()
        if not statuses:
            raise NoWorker(f"no worker answered for {model_id}; retry", retry_after_s=2.0)
        return _merge(statuses)

    async def tokenize(self, model_id: str, texts: list[str], add_special_tokens: bool = True,
                       prompt_name: str | None = None) -> list[list[Token]]:
        model_id = self._resolve(model_id)
        holders = self._holders(model_id)
        request = p.RpcRequest(model=model_id, texts=texts, add_special_tokens=add_special_tokens,
                               prompt_name=prompt_name)
        subject = p.rpc_subject("tokenize", self._pool_of(holders), model_id)
        try:
            msg = await self._nc.request(subject, msgspec.msgpack.encode(request),
                                         timeout=self.cluster.publish_timeout_s * 2)
        except Exception as exc:  # noqa: BLE001
            raise NoWorker(f"no worker answered the tokenize request for {model_id} ({type(exc).__name__}); retry",
                           retry_after_s=2.0) from None
        reply = msgspec.msgpack.decode(msg.data, type=p.RpcReply)
        if reply.error:
            raise ErrorResult(**reply.error).error()
        return reply.tokens or []

    async def _rpc_all(self, action: str, model_id: str, request: p.RpcRequest, expected: int,
                       pools: set[str]) -> list[p.RpcReply]:
        """Send to every worker of `pools` serving the model; the replies of up to `expected` of them."""
        inbox = self._nc.new_inbox()
        replies: list[p.RpcReply] = []
        done = asyncio.Event()

        async def collect(msg) -> None:
            replies.append(msgspec.msgpack.decode(msg.data, type=p.RpcReply))
            if len(replies) >= expected:
                done.set()

        sub = await self._nc.subscribe(inbox, cb=collect)
        try:
            for pool in pools:
                await self._nc.publish(p.rpc_subject(action, pool, model_id), msgspec.msgpack.encode(request),
                                       reply=inbox)
            try:
                # A load may take as long as the engine's load timeout.
                await asyncio.wait_for(done.wait(), self.settings.engine.load_timeout_s + 5.0)
            except asyncio.TimeoutError:
                pass
        finally:
            await sub.unsubscribe()
        return replies


def _merge(holders: list[tuple[Any, ModelStatus]]) -> ModelStatus:
    """One status of a model from its workers': loaded if any has it loaded (then that one's)."""
    statuses = [status for _, status in holders]
    order = {"loaded": 0, "loading": 1, "not_loaded": 2, "failed": 3}
    best = min(statuses, key=lambda s: order.get(s.state, 4))
    adapters_loaded = tuple(sorted({a for s in statuses for a in s.adapters_loaded}))
    return msgspec.structs.replace(best, adapters_loaded=adapters_loaded, pinned=any(s.pinned for s in statuses))
