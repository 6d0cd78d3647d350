"""`Worker`: engines without HTTP that pull calls from the cluster's work queue.

One worker process serves one host: one `Service` (an in-process Engine) per device, and one
host-local queue they share.

    JetStream consumer per model ──pull (sized by free capacity)──▶ host queue ──▶ device 0 engine
                                  ◀─nak(delay): what it over-pulled          └──▶ device 1 engine

- **Pull by capacity.** Each device holds about `prefetch_s` of work at its measured tokens/s
  (at least `min_inflight_tokens`), counted in the gateway's token estimates. A puller per model
  asks for as many calls as the host's free tokens predict (from the mean size of that model's
  calls); a call that does not fit when it arrives is `nak`ed with `nak_delay_s`, so another
  worker takes it, except on its last allowed delivery (a nak would dead-letter it).
- **Host-local queue.** A device takes the next call when it has room, preferring one whose
  model it has loaded, so work pulled for the host moves to whichever device frees up first
  without going back through NATS.
- **Each call**: dropped unrun if its deadline has passed or its caller went away (`shoal.cancel`);
  else run by the device's engine (which forms the batches) with the time left as its timeout,
  `in_progress()` sent every `ack_wait_s / 3` while it runs; then the result (or error) is sent to
  the caller's reply subject (through the Object Store when larger than the message limit), and
  only then the message acked. A worker that dies before the ack leaves it to be redelivered.
- **SIGTERM drains**: stop pulling, hand back (nak) what is queued on the host, finish and answer
  what runs, ack, say `draining` in a last heartbeat, exit.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import Counter, Gauge

from .. import calls
from ..config import ClusterSettings
from ..errors import InvalidRequest, ShoalError
from ..metrics import Metrics
from ..service import Service
from . import protocol as p

log = logging.getLogger("shoal.worker")

# How long one pull waits for calls before it checks for a drain or for room again.
PULL_WAIT_S = 1.0
# Most calls asked for in one pull.
MAX_FETCH = 64
# Request ids cancelled recently (a worker may pull the call after the cancel was broadcast).
_CANCEL_MEMORY_S = 600.0


class WorkerMetrics:
    def __init__(self, registry) -> None:
        r = registry
        self.calls = Counter("shoal_worker_calls", "Calls a worker finished, by outcome: ok, error, dropped_deadline "
                             "(never run: its deadline had passed), dropped_cancelled (its caller went away)",
                             ["model", "outcome"], registry=r)
        self.pulled = Counter("shoal_worker_pulled_calls", "Calls pulled from the work queue", ["model"], registry=r)
        self.naks = Counter("shoal_worker_naks", "Calls handed back to the queue: over-pulled (no room when they "
                            "arrived) or drained (the worker was stopping)", ["model", "reason"], registry=r)
        self.redelivered = Counter("shoal_worker_redelivered_calls", "Calls received again after an earlier "
                                   "delivery went unacked (a worker died, or ran past ack_wait)", ["model"], registry=r)
        self.held_tokens = Gauge("shoal_worker_held_tokens", "Estimated tokens of the calls the worker holds "
                                 "(queued on the host or running)", registry=r)
        self.host_queue = Gauge("shoal_worker_host_queue_calls", "Calls pulled and waiting for a device", registry=r)


@dataclass(eq=False)
class _Job:
    msg: Any
    model_id: str
    tokens: int
    request_id: str
    deadline: float  # unix seconds
    reply: str | None
    obj: str | None


@dataclass(eq=False)
class _Device:
    name: str
    service: Service
    held_tokens: int = 0
    running: set = field(default_factory=set)


class Worker:
    """Pulls the calls of the models `services` serve (every service has the same catalog) and runs them."""

    def __init__(self, services: list[Service], settings: ClusterSettings, *, devices: list[str] | None = None,
                 metrics: Metrics | None = None, worker_id: str | None = None, preload: tuple[str, ...] = ()) -> None:
        if not services:
            raise InvalidRequest("a worker needs at least one device")
        self.settings = settings
        self.metrics = metrics or services[0].metrics
        self.wm = WorkerMetrics(self.metrics.registry)
        names = devices or [f"device{i}" for i in range(len(services))]
        self.devices = [_Device(name, service) for name, service in zip(names, services)]
        self.host = socket.gethostname()
        self.id = worker_id or f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.preload = preload
        self._queue: collections.deque[_Job] = collections.deque()
        self._changed = asyncio.Condition()
        self._cancelled: dict[str, float] = {}
        self._running_calls: dict[str, set] = {}  # request id -> its engine tasks (to cancel)
        self._mean_tokens: dict[str, float] = {}
        self._draining = False
        self._closing = False
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None
        self._tasks: list[asyncio.Task] = []
        self._pullers: list[asyncio.Task] = []
        self.started = asyncio.Event()  # set once it pulls

    @property
    def model_ids(self) -> list[str]:
        return [status.id for status in self.devices[0].service.models()]

    # --- lifecycle ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain."""
        for device in self.devices:
            await device.service.start()
        for device in self.devices:
            await device.service.warm(list(self.preload))
        self._nc = await p.connect(self.settings.nats_url, f"shoal-worker {self.id}",
                                   on_reconnect=self._on_reconnect, quiet=lambda: self._closing)
        self._js = self._nc.jetstream()
        await self._setup()
        await self._nc.subscribe(p.CANCEL_SUBJECT, cb=self._on_cancel)
        await self._nc.subscribe(p.PING_SUBJECT, cb=self._on_ping)
        for model_id in self.model_ids:
            await self._nc.subscribe(p.rpc_subject("admin", self.settings.pool, model_id), cb=self._on_admin)
            await self._nc.subscribe(p.rpc_subject("tokenize", self.settings.pool, model_id), queue="tokenize",
                                     cb=self._on_tokenize)
        self._tasks.append(asyncio.create_task(self._heartbeats(), name="worker-heartbeats"))
        for device in self.devices:
            self._tasks.append(asyncio.create_task(self._device_loop(device), name=f"worker-{device.name}"))
        self._pullers = [asyncio.create_task(self._pull(model_id), name=f"pull {model_id}")
                         for model_id in self.model_ids]
        self.started.set()
        log.info("worker %s: pulling %d models on %s from %s (pool %s)", self.id, len(self._pullers),
                 ", ".join(d.name for d in self.devices), self.settings.nats_url, self.settings.pool)
        await stop.wait()
        await self.drain()

    async def drain(self) -> None:
        log.info("worker %s: draining", self.id)
        async with self._changed:
            self._draining = True
            self._changed.notify_all()  # pullers waiting for room stop waiting
        await self._beat()
        await asyncio.gather(*self._pullers, return_exceptions=True)  # each returns after its current pull
        while self._queue:  # hand back what no device started: a sibling takes it now
            job = self._queue.popleft()
            await self._hand_back(job, "drained")
        self.wm.host_queue.set(0)
        running = [task for device in self.devices for task in device.running]
        if running:
            await asyncio.wait(running)
        await self._beat()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._closing = True
        await _close(self._nc)
        for device in self.devices:
            await device.service.stop()
        log.info("worker %s: drained and stopped", self.id)

    async def _setup(self) -> None:
        while True:
            try:
                await p.ensure_queue(self._js, self.settings)
                for model_id in self.model_ids:
                    await p.ensure_consumer(self._js, self.settings, self.settings.pool, model_id)
                self._store = await self._js.object_store(p.PAYLOADS)
                return
            except Exception as exc:  # noqa: BLE001 (JetStream not ready yet)
                log.warning("worker %s: cannot set up the work queue yet (%s); retrying", self.id, exc)
                await asyncio.sleep(0.5)

    async def _on_reconnect(self) -> None:
        asyncio.get_running_loop().create_task(self._setup())

    # --- capacity -------------------------------------------------------------------------------

    def _budget(self, device: _Device) -> int:
        rate = device.service.capacity().tokens_per_s
        return max(self.settings.min_inflight_tokens, int((rate or 0) * self.settings.prefetch_s))

    def _held(self) -> int:
        return sum(job.tokens for job in self._queue) + sum(d.held_tokens for d in self.devices)

    def _room(self) -> int:
        """Tokens the host takes more of: each device's room under its budget (a device stuck over
        its own takes none of a sibling's), less what waits on the host for a device."""
        return (sum(max(0, self._budget(d) - d.held_tokens) for d in self.devices)
                - sum(job.tokens for job in self._queue))

    def _idle_device(self) -> bool:
        """A device runs nothing and nothing waits for one: any call fits, however large."""
        return not self._queue and any(not d.held_tokens for d in self.devices)

    def _wants_work(self) -> bool:
        return self._room() > 0 or self._idle_device()

    def _record(self) -> None:
        self.wm.held_tokens.set(self._held())
        self.wm.host_queue.set(len(self._queue))

    # --- pulling --------------------------------------------------------------------------------

    async def _pull(self, model_id: str) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        sub = None
        while not self._draining:
            try:
                async with self._changed:
                    await self._changed.wait_for(lambda: self._draining or self._wants_work())
                if self._draining:
                    break
                if sub is None:
                    sub = await self._js.pull_subscribe(p.work_subject(self.settings.pool, model_id),
                                                        durable=p.consumer_name(self.settings.pool, model_id),
                                                        stream=p.STREAM)
                mean = self._mean_tokens.get(model_id, 64.0)
                batch = max(1, min(MAX_FETCH, int(self._room() / max(1.0, mean))))
                try:
                    msgs = await sub.fetch(batch, timeout=PULL_WAIT_S)
                except (NatsTimeout, asyncio.TimeoutError):
                    continue
                for msg in msgs:
                    await self._take(msg, model_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (disconnected; consumer gone with a lost store)
                log.warning("worker %s: pulling %s: %s; retrying", self.id, model_id, exc)
                sub = None
                await asyncio.sleep(0.5)
                if self._nc.is_connected:
                    try:
                        await p.ensure_consumer(self._js, self.settings, self.settings.pool, model_id)
                    except Exception:  # noqa: BLE001
                        pass

    async def _take(self, msg: Any, model_id: str) -> None:
        headers = msg.headers or {}
        try:
            tokens = max(1, int(headers.get(p.TOKENS, "1")))
            deadline = float(headers.get(p.DEADLINE, "inf"))
        except ValueError:
            tokens, deadline = 1, float("inf")
        job = _Job(msg, model_id, tokens, headers.get(p.REQUEST_ID, "?"), deadline, headers.get(p.REPLY),
                   headers.get(p.OBJECT))
        self.wm.pulled.labels(model_id).inc()
        delivered = msg.metadata.num_delivered
        if delivered > 1:
            self.wm.redelivered.labels(model_id).inc()
        mean = self._mean_tokens.get(model_id)
        self._mean_tokens[model_id] = tokens if mean is None else 0.9 * mean + 0.1 * tokens
        last_chance = delivered >= self.settings.max_deliver
        if self._draining and not last_chance:
            await self._hand_back(job, "drained")
            return
        if tokens > self._room() and not self._idle_device() and not last_chance:
            # Later deliveries come back later: a call keeps its deliveries for real failures.
            await self._hand_back(job, "over_pulled", min(1.0, self.settings.nak_delay_s * 2 ** (delivered - 1)))
            return
        async with self._changed:
            self._queue.append(job)
            self._record()
            self._changed.notify_all()

    async def _hand_back(self, job: _Job, reason: str, delay: float | None = None) -> None:
        self.wm.naks.labels(job.model_id, reason).inc()
        try:
            await job.msg.nak(delay=delay)
        except Exception:  # noqa: BLE001 (disconnected: it is redelivered after ack_wait anyway)
            pass

    # --- devices --------------------------------------------------------------------------------

    async def _device_loop(self, device: _Device) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self._queue and (not device.held_tokens or device.held_tokens < self._budget(device)))
                job = self._pick(device)
                device.held_tokens += job.tokens
                self._record()
                self._changed.notify_all()  # the host queue shrank: a puller may take more
            task = asyncio.create_task(self._run(device, job), name=f"call {job.request_id}")
            device.running.add(task)
            task.add_done_callback(device.running.discard)

    def _pick(self, device: _Device) -> _Job:
        """The first queued call whose model this device has loaded (of the next few), else the first."""
        for index, job in enumerate(list(self._queue)[:16]):
            try:
                loaded = device.service.model(job.model_id).loaded
            except ShoalError:
                loaded = False
            if loaded:
                del self._queue[index]
                return job
        return self._queue.popleft()

    async def _run(self, device: _Device, job: _Job) -> None:
        try:
            await self._serve(device, job)
        except Exception:  # noqa: BLE001 (never kill the loop; the message is redelivered)
            log.exception("worker %s: request %s failed outside its engine", self.id, job.request_id)
        finally:
            async with self._changed:
                device.held_tokens -= job.tokens
                self._record()
                self._changed.notify_all()

    async def _serve(self, device: _Device, job: _Job) -> None:
        if job.request_id in self._cancelled:
            await self._drop(job, "dropped_cancelled")
            return
        remaining = job.deadline - p.now()
        if remaining <= 0:
            await self._drop(job, "dropped_deadline")
            return
        try:
            data = job.msg.data
            if job.obj:
                data = (await self._store.get(job.obj)).data
            call = calls.decode_call(data)
            call = msgspec.structs.replace(call, timeout_s=remaining, request_id=job.request_id)
        except Exception as exc:  # noqa: BLE001 (undecodable: answer it, never retry it)
            result = p.error_of(InvalidRequest(f"the worker could not read the call: {exc}"), job.request_id)
            await self._reply(job, result)
            await job.msg.term()
            return
        keep_alive = asyncio.create_task(self._keep_alive(job.msg))
        task = asyncio.create_task(device.service.run(call))
        self._running_calls.setdefault(job.request_id, set()).add(task)
        try:
            result = await task
            outcome = "ok"
        except asyncio.CancelledError:
            if job.request_id in self._cancelled and task.cancelled() and not _cancelling():
                await self._drop(job, "dropped_cancelled")
                return
            raise
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, ShoalError):
                log.exception("worker %s: request %s failed", self.id, job.request_id)
            result = p.error_of(exc, job.request_id)
            outcome = "error"
        finally:
            keep_alive.cancel()
            tasks = self._running_calls.get(job.request_id)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._running_calls[job.request_id]
        await self._reply(job, result)
        await job.msg.ack()
        self.wm.calls.labels(job.model_id, outcome).inc()

    async def _drop(self, job: _Job, outcome: str) -> None:
        await job.msg.ack()  # done with: never computed, never redelivered
        self.wm.calls.labels(job.model_id, outcome).inc()
        log.info("worker %s: request %s dropped unrun (%s)", self.id, job.request_id, outcome)

    async def _keep_alive(self, msg: Any) -> None:
        while True:
            await asyncio.sleep(max(0.1, self.settings.ack_wait_s / 3))
            try:
                await msg.in_progress()
            except Exception:  # noqa: BLE001
                pass

    async def _reply(self, job: _Job, result: Any) -> None:
        if not job.reply:
            return
        data = calls.encode(result)
        headers = None
        if len(data) > self._nc.max_payload - self.settings.payload_headroom_bytes:
            name = f"result-{uuid.uuid4().hex}"
            await self._store.put(name, data)
            headers, data = {p.OBJECT: name}, b""
        await self._nc.publish(job.reply, data, headers=headers)

    # --- control --------------------------------------------------------------------------------

    async def _on_cancel(self, msg: Any) -> None:
        request_id = msg.data.decode(errors="replace")
        now = time.monotonic()
        self._cancelled[request_id] = now
        for rid, when in list(self._cancelled.items()):
            if when < now - _CANCEL_MEMORY_S:
                del self._cancelled[rid]
        for task in self._running_calls.get(request_id, ()):
            task.cancel()
        held = [job for job in self._queue if job.request_id == request_id]
        for job in held:  # pulled, not started: done with now
            self._queue.remove(job)
            await self._drop(job, "dropped_cancelled")
        if held:
            async with self._changed:
                self._record()
                self._changed.notify_all()

    async def _on_ping(self, msg: Any) -> None:
        await self._beat()

    async def _heartbeats(self) -> None:
        while True:
            await self._beat()
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _beat(self) -> None:
        first = self.devices[0].service
        statuses = first.models()
        if len(self.devices) > 1:  # loaded on any device: loaded on the host
            loaded = {s.id for d in self.devices[1:] for s in d.service.models() if s.loaded}
            statuses = [msgspec.structs.replace(s, loaded=True, state="loaded") if s.id in loaded and not s.loaded
                        else s for s in statuses]
        rates = [d.service.capacity().tokens_per_s for d in self.devices]
        beat = p.Heartbeat(
            worker=self.id, pool=self.settings.pool, host=self.host, devices=tuple(d.name for d in self.devices),
            models=statuses, problems=first.problems(), free_tokens=max(0, self._room()),
            inflight_tokens=self._held(), tokens_per_s=sum(r for r in rates if r) or None,
            draining=self._draining, sent_at=p.now())
        try:
            await self._nc.publish(f"{p.HEARTBEAT_PREFIX}.{p.token(self.id)}", msgspec.msgpack.encode(beat))
        except Exception:  # noqa: BLE001 (disconnected)
            pass

    async def _on_admin(self, msg: Any) -> None:
        request = msgspec.msgpack.decode(msg.data, type=p.RpcRequest)
        try:
            statuses = [await device.service.admin(request.model, request.action) for device in self.devices]
            reply = p.RpcReply(worker=self.id, status=statuses[0])
        except Exception as exc:  # noqa: BLE001
            reply = p.RpcReply(worker=self.id, error=msgspec.structs.asdict(p.error_of(exc, None)))
        await msg.respond(msgspec.msgpack.encode(reply))

    async def _on_tokenize(self, msg: Any) -> None:
        request = msgspec.msgpack.decode(msg.data, type=p.RpcRequest)
        device = min(self.devices, key=lambda d: d.held_tokens)
        try:
            tokens = await device.service.tokenize(request.model, request.texts, request.add_special_tokens,
                                                   request.prompt_name)
            reply = p.RpcReply(worker=self.id, tokens=[[(t.id, t.text, t.special, t.start, t.stop) for t in row]
                                                       for row in tokens])
        except Exception as exc:  # noqa: BLE001
            reply = p.RpcReply(worker=self.id, error=msgspec.structs.asdict(p.error_of(exc, None)))
        await msg.respond(msgspec.msgpack.encode(reply))


async def _close(nc: Any) -> None:
    """Flush what is sent (replies, acks), then close (no reconnect attempts, no callbacks)."""
    try:
        await asyncio.wait_for(nc.flush(), 5.0)
    except Exception:  # noqa: BLE001 (NATS gone: unacked calls are redelivered)
        pass
    await nc.close()


def _cancelling() -> bool:
    """Whether the current task itself is being cancelled (a drain or shutdown, not a call's cancel)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())
