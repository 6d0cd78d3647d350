"""`RemoteService`: the `Service` a cluster gateway serves its HTTP routes over (torch-free).

The gateway reads only a call's envelope: it resolves the model (an alias to its id; a typo is a
404 from the catalog), picks a pool whose live workers serve it, and publishes the call, with a
request id, a deadline and a token estimate in its headers, to `shoal.work.<pool>.<model>` on the
JetStream work queue. It then awaits the worker's reply on its own inbox:

    run(call) ─ resolve ─ no live worker? ─────────────── 503 no_worker + Retry-After, demand gauge
              │                NATS down? ─────────────── 503 queue_unavailable
              ├ larger than the message limit: body to the Object Store, the message names it
              ├ publish (JetStream acks it: stored) ───── no ack in publish_timeout_s: 503
              ├ await the reply (result, or an error result) until the deadline (+ a grace);
              │   a streamed generation's updates come to the same inbox before it (`stream`)
              └ finally, unanswered (deadline, client gone): delete the message from the stream
                (not yet delivered: never computed) and broadcast the request id on shoal.cancel
                (delivered: the worker drops it); the call's object is deleted in every case

Its other jobs each have a module: `publishing` (a call's publish, the wait for its reply, its
abandonment, and the recheck of lost replies after a reconnect), `directory` (the live workers,
from their heartbeats: what `models()`, `capacity()` and routing read), `rpc` (admin, tokenize and
detokenize on the workers), `payloads` (the Object Store), `dead_letters` (calls no worker answered),
`queue_gauges` (the queue as JetStream sees it, on /metrics), `backlog` (the same, for the workers'
cold looks).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec

from .. import calls
from ..calls import AnyCall, AnyResult, ErrorResult, GenerateCall, Generated, GenerateResult, stream_updates, timeout_of
from ..catalog import Catalog
from ..config import Settings
from ..errors import ConfigError, QueueUnavailable
from ..metrics import GatewayMetrics, Metrics
from ..service import Capacity, CardProblem, ModelStatus, Token
from ..verbs import estimate_tokens
from . import backlog, dead_letters, payloads, publishing, queue_gauges, rpc
from . import protocol as p
from .directory import Holders, WorkerDirectory
from .nats_auth import connect_options
from .publishing import time_left_s

__all__ = ["GatewayMetrics", "RemoteService"]

log = logging.getLogger("shoal.gateway")


class RemoteService:
    """Serves calls by the cluster's workers (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        *,
        metrics: Metrics | None = None,
        consumers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.settings = settings
        # (pool, model) consumers made at setup, before any worker of the pool runs: a pool scaled
        # to zero has its consumers, so KEDA's nats-jetstream trigger reads their lag (of a missing
        # consumer it reads the whole stream's) and the queue gauges show them.
        self.consumers = consumers
        self.cluster = settings.cluster
        connect_options(self.cluster)  # a ConfigError now (a missing file, a user without password), not at connect
        if self.cluster.payload_ttl_s <= settings.engine.request_timeout_s:
            raise ConfigError(
                f"payload_ttl_s ({self.cluster.payload_ttl_s:g}) must be above request_timeout_s "
                f"({settings.engine.request_timeout_s:g}): a large call's payload would expire before its deadline"
            )
        self.catalog = catalog
        self.metrics = metrics or Metrics()
        self.gm = GatewayMetrics(self.metrics.registry)
        self.gm.start_models(card.id for card in catalog)
        self.workers = WorkerDirectory(self.cluster, catalog, self.gm)
        self.id = f"gw-{uuid.uuid4().hex[:12]}"
        self._inbox = f"_INBOX.shoal.{self.id}"
        self._pending: dict[str, asyncio.Future[Any]] = {}  # call key -> its reply
        self._sequences: dict[str, int] = {}  # call key -> its stream sequence, once stored
        self._progress: dict[str, Callable[[Generated], None]] = {}  # call key -> its updates' taker
        self._background: set[asyncio.Task[None]] = set()
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._queue_ready = False
        self._started = False
        self._stopping = False

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Returns at once: the connection is made (and remade) in the background, so a gateway
        starts, and answers 503, while NATS is down."""
        self._started = True
        self._run_task(self._connect(), "gateway-connect")
        self._run_task(self.workers.keep_gauges(), "gateway-tick")

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

    def _run_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """A loop that runs until `stop`; one that dies of an error says so in the log."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_death)
        self._tasks.append(task)

    async def _connect(self) -> None:
        nc = await p.connect(
            self.cluster,
            f"shoal-gateway {self.id}",
            on_disconnect=self._on_disconnect,
            on_reconnect=self._on_reconnect,
            quiet=lambda: self._stopping,
        )
        self._nc, self._js = nc, nc.jetstream()
        await nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        await nc.subscribe(f"{p.HEARTBEAT_PREFIX}.>", cb=self.workers.on_heartbeat)
        await self._setup()
        self._run_task(
            dead_letters.read(nc, self._js, self.gm, self.cluster.max_deliver, lambda: self._stopping),
            "gateway-dead-letters",
        )
        self._run_task(queue_gauges.watch(self._js, self.gm, self._connected), "gateway-queue-gauges")
        self._run_task(
            backlog.publish(nc, self._js, self.id, self.cluster.backlog_s, self._connected), "gateway-backlog"
        )

    async def _setup(self) -> None:
        """Streams and bucket (a NATS that lost its store gets them back), then every heartbeat."""
        from nats.js.errors import BadRequestError

        while not self._stopping:
            try:
                await p.ensure_queue(self._js, self.cluster)
                self._store = await self._js.object_store(p.PAYLOADS)
                for pool, model_id in self.consumers:
                    try:
                        await p.ensure_consumer(self._js, self.cluster, pool, model_id)
                    except BadRequestError as exc:  # made by a worker with other settings: it stays as it is
                        log.warning(
                            "gateway: consumer of pool %s for %s exists with another configuration (%s)",
                            pool,
                            model_id,
                            exc,
                        )
                self._queue_ready = True
                self.gm.connected.set(1)
                await self._nc.publish(p.PING_SUBJECT, b"")
                return
            except Exception as exc:  # broad: retried until it works (NATS not up yet, JetStream starting)
                log.warning(
                    "gateway: cannot set up the work queue yet (%s); retrying", exc, exc_info=not p.is_nats_error(exc)
                )
                await asyncio.sleep(0.5)

    async def _on_disconnect(self) -> None:
        self._queue_ready = False
        self.gm.connected.set(0)

    async def _on_reconnect(self) -> None:
        async def setup_then_recheck() -> None:
            await self._setup()
            await publishing.recheck(self._js, self._sequences, self._pending, lambda: self._stopping)

        self._spawn(setup_then_recheck())

    # --- Service: statuses (from the workers' heartbeats) ----------------------------------------

    def models(self) -> list[ModelStatus]:
        return self.workers.models()

    def model(self, model_id: str) -> ModelStatus:
        return self.workers.model(model_id)

    def has_model(self, model_id: str) -> bool:
        return self.workers.has_model(model_id)

    def problems(self) -> list[CardProblem]:
        return self.workers.problems()

    def capacity(self) -> Capacity:
        return self.workers.capacity()

    def _pool_for(self, model_id: str) -> str:
        """The pool a call of the model goes to; QueueUnavailable and NoWorker as `_holders`."""
        self._require_queue()
        return self.workers.pool_for(model_id)

    def _holders(self, model_id: str) -> Holders:
        """The live workers serving the model; QueueUnavailable while NATS is, NoWorker when none does."""
        self._require_queue()
        return self.workers.holders(model_id)

    def _require_queue(self) -> None:
        if not self._connected():
            raise QueueUnavailable(
                "the cluster's work queue (NATS) is unreachable from this gateway; retry shortly", retry_after_s=2.0
            )

    # --- Service: control (over core NATS request/reply to the workers) --------------------------

    async def admin(self, model_id: str, action: str) -> ModelStatus:
        """The action on every live worker that serves the model; the merged status after it."""
        model_id = self.workers.resolve(model_id)
        # A load may take as long as the engine's load timeout.
        return await rpc.admin(
            self._nc, model_id, action, self._holders(model_id), self.settings.engine.load_timeout_s + 5.0
        )

    async def tokenize(
        self,
        model_id: str,
        texts: list[str],
        add_special_tokens: bool = True,
        prompt_name: str | None = None,
        *,
        may_download: bool = True,
    ) -> list[list[Token]]:
        model_id = self.workers.resolve(model_id)
        pool = self._pool_for(model_id)
        request = p.RpcRequest(
            model=model_id,
            texts=texts,
            add_special_tokens=add_special_tokens,
            prompt_name=prompt_name,
            may_download=may_download,
        )
        return await rpc.tokenize(self._nc, pool, request, self.cluster.publish_timeout_s * 2)

    async def detokenize(
        self,
        model_id: str,
        ids: list[list[int]],
        skip_special_tokens: bool = True,
        *,
        may_download: bool = True,
    ) -> list[str]:
        model_id = self.workers.resolve(model_id)
        pool = self._pool_for(model_id)
        request = p.RpcRequest(
            model=model_id, ids=ids, skip_special_tokens=skip_special_tokens, may_download=may_download
        )
        return await rpc.detokenize(self._nc, pool, request, self.cluster.publish_timeout_s * 2)

    # --- Service: calls -------------------------------------------------------------------------

    async def run(self, call: AnyCall) -> AnyResult:
        return await self._call(call, None)

    def stream(self, call: GenerateCall) -> AsyncIterator[Generated | GenerateResult]:
        """A generation as its worker sends it: a `Generated` per update (its whole text so far;
        its token ids stay on the worker), then the GenerateResult. Leaving early abandons the call
        (the worker cancels the generation), as a client gone does for `run`."""
        return stream_updates(lambda on_update: self._call(call, on_update))

    async def _call(self, call: AnyCall, on_update: Callable[[Generated], None] | None) -> AnyResult:
        """`run`; with `on_update`, the worker is asked for the generation's progress, and each
        update it sends is passed to `on_update` before the answer comes."""
        model_id = self.workers.resolve(call.model)
        pool = self._pool_for(model_id)
        timeout_s = timeout_of(call, self.settings.engine.request_timeout_s)
        deadline = time.monotonic() + timeout_s
        key = uuid.uuid4().hex
        request_id = call.request_id or key
        call = msgspec.structs.replace(call, model=model_id, request_id=request_id, timeout_s=timeout_s)
        data = calls.encode(call)
        headers = {
            p.REQUEST_ID: request_id,
            p.DEADLINE: f"{p.now() + timeout_s:.6f}",
            p.TOKENS: str(estimate_tokens(call, self.catalog.find(model_id))),
            p.REPLY: f"{self._inbox}.{key}",
            p.MSG_ID: key,
        }
        if on_update is not None:
            headers[p.PROGRESS] = "1"
            self._progress[key] = on_update
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
            if payloads.over_limit(data, self._nc.max_payload, self.cluster.payload_headroom_bytes):
                obj = f"call-{key}"
                await payloads.put_call(self._store, obj, data, time_left_s(deadline), request_id)
                self.gm.objects.labels("call").inc()
                headers[p.OBJECT] = obj
                data = b""
            attempted = True
            subject = p.work_subject(pool, model_id)
            seq = await publishing.publish(
                self._js, self.cluster, subject, data, headers, deadline, request_id, self._connected
            )
            self._sequences[key] = seq
            self.gm.published.labels(model_id, pool).inc()
            reply = await publishing.await_reply(future, deadline, request_id)
            answered = True
            result = await self._read_result(reply, deadline, request_id)
        except asyncio.CancelledError:
            reason = "cancelled"  # the client went away (the API cancels its handler)
            raise
        finally:
            self._pending.pop(key, None)
            self._progress.pop(key, None)
            self._sequences.pop(key, None)
            inflight.dec()
            if not answered and (seq is not None or attempted):
                # Also when the publish's ack was lost: the call may be stored, its worker drops it.
                self.gm.abandoned.labels(model_id, reason).inc()
                self._spawn(publishing.abandon(self._js, self._nc, seq, key))
            if obj is not None:
                self._spawn(payloads.delete_object(self._store, obj))
        if isinstance(result, ErrorResult):
            error = result.error()
            error.details.setdefault("request_id", request_id)
            raise error
        return result

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A background task, referenced until done (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_reply(self, msg: Any) -> None:
        key = msg.subject.rsplit(".", 1)[-1]
        if msg.headers and msg.headers.get(p.PROGRESS):  # a generation's update, before its answer
            on_update = self._progress.get(key)
            if on_update is not None:
                try:
                    on_update(p.decode_progress(msg.data))
                except msgspec.DecodeError as exc:
                    log.warning("gateway: an unreadable progress message for call %s: %r", key, exc)
            return
        future = self._pending.get(key)
        if future is not None and not future.done():
            future.set_result(msg)
        elif msg.headers and msg.headers.get(p.OBJECT):  # a second answer (a redelivery) or a late one
            await payloads.delete_object(self._store, msg.headers[p.OBJECT])

    async def _read_result(self, msg: Any, deadline: float, request_id: str) -> AnyResult:
        try:
            data, name = await payloads.read_reply(self._store, msg, time_left_s(deadline) + 5.0)
            if name:
                self.gm.objects.labels("result").inc()
                self._spawn(payloads.delete_object(self._store, name))
            return calls.decode_result(data)
        except Exception as exc:  # broad: NATS failing mid-read, or a reply no decoder reads (which may raise anything)
            log.warning(
                "gateway: the answer to request %s could not be read: %r",
                request_id,
                exc,
                exc_info=not isinstance(exc, (msgspec.DecodeError, *p.nats_errors())),
            )
            raise QueueUnavailable(
                f"the worker's answer could not be read ({type(exc).__name__}); retry",
                retry_after_s=1.0,
                details={"request_id": request_id},
            ) from None


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("gateway: %s stopped", task.get_name(), exc_info=task.exception())
