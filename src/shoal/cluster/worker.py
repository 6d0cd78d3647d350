"""`Worker`: engines without HTTP that pull calls from the cluster's work queue.

One worker process serves one host: one `Service` (an in-process Engine) per device, and one
host-local queue they share.

    JetStream consumer per model ──pull (sized by free capacity)──▶ host queue ──▶ device 0 engine
                                  ◀─nak(delay): what it over-pulled          └──▶ device 1 engine

- **Pull by capacity.** Each device holds about `prefetch_s` of work at its own measured tokens/s
  (`min_inflight_tokens` before it has a rate), counted in the gateway's token estimates. A puller
  per model waits for one call, then asks for as many more as the host's room predicts (from the
  mean size of that model's calls), reserving what it asks for; a call that arrives when the host
  has no room left is `nak`ed (a delay doubling from `nak_delay_s`), so another worker takes it,
  except from its one-before-last delivery on (one delivery stays spare for a crash).
- **Host-local queue.** A device takes the next call when it has room (skipping ahead to a model
  it has loaded only when another device has the first call's model loaded), so work pulled for
  the host moves to whichever device frees up first without going back through NATS.
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
# After the first call of a pull, how long it waits for the rest of what is already queued.
MORE_WAIT_S = 0.005
# Most calls asked for in one pull.
MAX_FETCH = 64
# A measured device's budget never falls below this many tokens.
MIN_BUDGET_TOKENS = 256
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

    def start_models(self, model_ids) -> None:
        """Series at 0 for the models the worker serves (see `Metrics.start_models`)."""
        for model in model_ids:
            for outcome in ("ok", "error", "dropped_deadline", "dropped_cancelled"):
                self.calls.labels(model, outcome)
            for reason in ("over_pulled", "drained"):
                self.naks.labels(model, reason)
            self.pulled.labels(model)
            self.redelivered.labels(model)


@dataclass(eq=False)
class _Job:
    msg: Any
    model_id: str
    tokens: int
    request_id: str  # the caller's (logs, error bodies): not unique
    key: str  # the gateway's unique id of the call (its Nats-Msg-Id): what a cancel names
    deadline: float  # unix seconds
    reply: str | None
    obj: str | None
    keep: bool  # no delivery left to spare: never hand it back


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
        self.wm.start_models(self.model_ids)
        self.host = socket.gethostname()
        self.id = worker_id or f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.preload = preload
        self._queue: collections.deque[_Job] = collections.deque()
        self._changed = asyncio.Condition()
        self._cancelled: dict[str, float] = {}  # call key -> when (insertion order is time order)
        self._running_calls: dict[str, asyncio.Task] = {}  # call key -> its engine task (to cancel)
        self._mean_tokens: dict[str, float] = {}
        self._reserved = 0  # tokens pullers have asked NATS for and not yet received
        self._max_deliver: dict[str, int] = {}  # model -> its consumer's max_deliver, as NATS has it
        self._background: set[asyncio.Task] = set()
        self._draining = False
        self._closing = False
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None
        self._tasks: list[asyncio.Task] = []
        self._pullers: list[asyncio.Task] = []
        self.started = asyncio.Event()  # set once it pulls
        self._last_beat = 0.0  # time.monotonic() of the heartbeat loop's last turn (liveness)
        # How long a drain waits for running calls (past it they are left to be redelivered).
        self.drain_timeout_s = 120.0

    @property
    def model_ids(self) -> list[str]:
        return [status.id for status in self.devices[0].service.models()]

    # --- lifecycle ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain. A stop during start-up (preloads, NATS not up
        yet) stops at once."""
        startup = asyncio.create_task(self._start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([startup, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not startup.done():
            startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            if self._nc is not None:
                self._closing = True
                await self._nc.close()
            for device in self.devices:
                await device.service.stop()
            log.info("worker %s: stopped before it started pulling", self.id)
            return
        startup.result()
        await stopped
        await self.drain()

    async def _start(self) -> None:
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
        self._tasks.append(asyncio.create_task(self._keep_queued_alive(), name="worker-keep-alive"))
        for device in self.devices:
            self._tasks.append(asyncio.create_task(self._device_loop(device), name=f"worker-{device.name}"))
        self._pullers = [asyncio.create_task(self._pull(model_id), name=f"pull {model_id}")
                         for model_id in self.model_ids]
        self.started.set()
        log.info("worker %s: pulling %d models on %s from %s (pool %s)", self.id, len(self._pullers),
                 ", ".join(d.name for d in self.devices), p.redact(self.settings.nats_url), self.settings.pool)

    async def drain(self) -> None:
        log.info("worker %s: draining", self.id)
        async with self._changed:
            self._draining = True
            self._changed.notify_all()  # pullers waiting for room stop waiting
        await self._beat_safely()
        await asyncio.gather(*self._pullers, return_exceptions=True)  # each returns after its current pull
        async with self._changed:
            # Hand back what no device started (a sibling takes it now), except calls with no
            # delivery to spare: a nak would make them dead letters, so the devices run them.
            handed = [job for job in self._queue if not job.keep]
            for job in handed:
                self._queue.remove(job)
            self._record()
        for job in handed:
            await self._hand_back(job, "drained")
        deadline = time.monotonic() + self.drain_timeout_s
        while self._queue or any(device.running for device in self.devices):
            if time.monotonic() > deadline:
                log.warning("worker %s: calls still running after %.0f s of drain; leaving them to be redelivered",
                            self.id, self.drain_timeout_s)
                break
            running = [task for device in self.devices for task in device.running]
            if running:
                await asyncio.wait(running, timeout=max(0.01, deadline - time.monotonic()))
            else:
                await asyncio.sleep(0.05)
        await self._beat_safely()
        for task in [*self._tasks, *self._background]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        self._closing = True
        await _close(self._nc)
        for device in self.devices:
            await device.service.stop()
        log.info("worker %s: drained and stopped", self.id)

    async def _setup(self) -> None:
        while not self._closing:
            try:
                await p.ensure_queue(self._js, self.settings)
                for model_id in self.model_ids:
                    await self._ensure_consumer(model_id)
                self._store = await self._js.object_store(p.PAYLOADS)
                return
            except Exception as exc:  # noqa: BLE001 (JetStream not ready yet)
                log.warning("worker %s: cannot set up the work queue yet (%s); retrying", self.id, exc)
                await asyncio.sleep(0.5)

    async def _ensure_consumer(self, model_id: str) -> None:
        await p.ensure_consumer(self._js, self.settings, self.settings.pool, model_id)
        info = await self._js.consumer_info(p.STREAM, p.consumer_name(self.settings.pool, model_id))
        # The shared consumer's, which the last worker to start may have set: what NATS enforces.
        self._max_deliver[model_id] = info.config.max_deliver or self.settings.max_deliver

    async def _on_reconnect(self) -> None:
        self._spawn(self._setup())

    def _spawn(self, coro) -> None:
        """A background task, referenced until done (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- capacity -------------------------------------------------------------------------------

    def _budget(self, device: _Device) -> int:
        """Tokens the device holds: `prefetch_s` of work at its measured rate (a slow device holds
        less), `min_inflight_tokens` until it has a rate. Shallow on purpose: what a device does not
        hold waits in the shared queue for whichever device frees up first."""
        rate = device.service.capacity().tokens_per_s
        if not rate:
            return self.settings.min_inflight_tokens
        return max(MIN_BUDGET_TOKENS, int(rate * self.settings.prefetch_s))

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
        """Ask for the calls that fit the host's room. The tokens asked for are reserved until the
        pull returns, so the pullers of several models do not ask for the same room twice; with
        less than one call's worth unreserved, a puller asks for one call (which may not fit: then
        it goes back)."""
        from nats.errors import TimeoutError as NatsTimeout

        sub = None
        while not self._draining:
            reserved = 0
            try:
                async with self._changed:
                    await self._changed.wait_for(lambda: self._draining or self._wants_work())
                    if self._draining:
                        break
                    mean = max(1.0, self._mean_tokens.get(model_id, 64.0))
                    reserved = int(mean) if self._room() - self._reserved >= mean else 0
                    self._reserved += reserved
                if sub is None:
                    sub = await self._js.pull_subscribe_bind(
                        durable=p.consumer_name(self.settings.pool, model_id), stream=p.STREAM)
                # Wait for one call alone, then take at once what else is there and fits: nats-py's
                # fetch(n) may hold a call it has received until n have come or the pull expires.
                try:
                    first = await sub.fetch(1, timeout=PULL_WAIT_S)
                except (NatsTimeout, asyncio.TimeoutError):
                    first = []
                await self._unreserve(reserved)
                reserved = 0
                await self._take_all(first, model_id)
                if not first:
                    continue
                async with self._changed:  # the room now, after the first call and others' asks
                    more = int((self._room() - self._reserved) / mean)
                    if more > 0:
                        more = min(MAX_FETCH, more)
                        reserved = int(more * mean)
                        self._reserved += reserved
                if more > 0:
                    try:
                        rest = await sub.fetch(more, timeout=MORE_WAIT_S)
                    except Exception:  # noqa: BLE001 (nothing more queued; a status message)
                        rest = []
                    await self._unreserve(reserved)
                    reserved = 0
                    await self._take_all(rest, model_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (disconnected; consumer gone with a lost store)
                log.warning("worker %s: pulling %s: %s; retrying", self.id, model_id, exc)
                sub = None
                await asyncio.sleep(0.5)
                if self._nc.is_connected:
                    try:
                        await self._ensure_consumer(model_id)
                    except Exception:  # noqa: BLE001
                        pass
            finally:
                if reserved:
                    await self._unreserve(reserved)

    async def _take_all(self, msgs: list, model_id: str) -> None:
        for msg in msgs:
            try:
                await self._take(msg, model_id)
            except Exception as exc:  # noqa: BLE001 (closed connection, odd metadata): not the others' fault
                log.warning("worker %s: could not take a call of %s: %s", self.id, model_id, exc)
                try:
                    await msg.nak()
                except Exception:  # noqa: BLE001 (redelivered after ack_wait)
                    pass

    async def _unreserve(self, tokens: int) -> None:
        async with self._changed:
            self._reserved -= tokens
            self._changed.notify_all()

    async def _take(self, msg: Any, model_id: str) -> None:
        headers = msg.headers or {}
        try:
            tokens = max(1, int(headers.get(p.TOKENS, "1")))
            deadline = float(headers.get(p.DEADLINE, "inf"))
        except ValueError:
            tokens, deadline = 1, float("inf")
        delivered = msg.metadata.num_delivered
        # One delivery stays spare for a crash: from the one before last, a call is never handed back.
        keep = delivered >= self._max_deliver.get(model_id, self.settings.max_deliver) - 1
        job = _Job(msg, model_id, tokens, headers.get(p.REQUEST_ID, "?"), headers.get(p.MSG_ID, ""), deadline,
                   headers.get(p.REPLY), headers.get(p.OBJECT), keep)
        self.wm.pulled.labels(model_id).inc()
        if delivered > 1:
            self.wm.redelivered.labels(model_id).inc()
        mean = self._mean_tokens.get(model_id)
        self._mean_tokens[model_id] = tokens if mean is None else 0.9 * mean + 0.1 * tokens
        if job.key in self._cancelled:
            await self._drop(job, "dropped_cancelled")
            return
        if self._draining and not keep:
            await self._hand_back(job, "drained")
            return
        # Taken while the host has any room (as a device takes a call while under its budget), so
        # a call a little over the room does not bounce; handed back only with no room at all.
        if self._room() <= 0 and not self._idle_device() and not keep:
            # Later deliveries come back later.
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
            try:
                async with self._changed:
                    await self._changed.wait_for(
                        lambda: self._queue and (not device.held_tokens or device.held_tokens < self._budget(device)))
                    job = self._pick(device)
                    device.held_tokens += job.tokens
                    self._record()
                    self._changed.notify_all()  # the host queue shrank: a puller may take more
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 (a service's capacity() or model() failing: keep the device serving)
                log.exception("worker %s: %s could not take a call", self.id, device.name)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._run(device, job), name=f"call {job.request_id}")
            device.running.add(task)
            task.add_done_callback(device.running.discard)

    def _loaded(self, device: _Device, model_id: str) -> bool:
        try:
            return device.service.model(model_id).loaded
        except ShoalError:
            return False

    def _pick(self, device: _Device) -> _Job:
        """The first queued call, unless another device has its model loaded (and will take it):
        then the first of the next few whose model this device has loaded. A single device, or a
        model loaded nowhere, keeps the queue's order (no call waits behind later ones)."""
        head = self._queue[0]
        if len(self.devices) > 1 and not self._loaded(device, head.model_id) and any(
                self._loaded(other, head.model_id) for other in self.devices if other is not device):
            for index, job in enumerate(list(self._queue)[1:16], start=1):
                if self._loaded(device, job.model_id):
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
        if job.key in self._cancelled:
            await self._drop(job, "dropped_cancelled")
            return
        if job.deadline - p.now() <= 0:
            await self._drop(job, "dropped_deadline")
            return
        try:
            data = job.msg.data
            if job.obj:
                data = await asyncio.wait_for(p.read_object(self._store, job.obj),
                                              max(0.01, job.deadline - p.now()))
            call = calls.decode_call(data)
        except asyncio.TimeoutError:
            await self._drop(job, "dropped_deadline")
            return
        except Exception as exc:  # noqa: BLE001 (undecodable, or its object gone: answer it, never retry it)
            result = p.error_of(InvalidRequest(f"the worker could not read the call: {exc}"), job.request_id)
            await self._reply(job, result)
            await job.msg.term()
            return
        remaining = job.deadline - p.now()
        if job.key in self._cancelled or remaining <= 0:  # while its object was read
            await self._drop(job, "dropped_cancelled" if job.key in self._cancelled else "dropped_deadline")
            return
        call = msgspec.structs.replace(call, timeout_s=remaining, request_id=job.request_id)
        keep_alive = asyncio.create_task(self._keep_alive(job.msg))
        task = asyncio.create_task(device.service.run(call))
        self._running_calls[job.key] = task
        try:
            result = await task
            outcome = "ok"
        except asyncio.CancelledError:
            if job.key in self._cancelled and task.cancelled() and not _cancelling():
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
            self._running_calls.pop(job.key, None)
        await self._reply(job, result)
        await job.msg.ack()
        self.wm.calls.labels(job.model_id, outcome).inc()

    async def _drop(self, job: _Job, outcome: str) -> None:
        await job.msg.ack()  # done with: never computed, never redelivered
        self.wm.calls.labels(job.model_id, outcome).inc()
        log.info("worker %s: request %s dropped unrun (%s)", self.id, job.request_id, outcome)

    async def _keep_queued_alive(self) -> None:
        """Calls waiting on the host for a device are kept from redelivery too."""
        while True:
            await asyncio.sleep(max(0.1, self.settings.ack_wait_s / 3))
            for job in list(self._queue):
                try:
                    await job.msg.in_progress()
                except Exception:  # noqa: BLE001
                    pass

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
            name = f"result-{job.key or uuid.uuid4().hex}"
            await self._store.put(name, data)
            headers, data = {p.OBJECT: name}, b""
        await self._nc.publish(job.reply, data, headers=headers)

    # --- control --------------------------------------------------------------------------------

    async def _on_cancel(self, msg: Any) -> None:
        key = msg.data.decode(errors="replace")
        now = time.monotonic()
        while self._cancelled:  # oldest first: forget what is too old to be pulled still
            oldest = next(iter(self._cancelled))
            if self._cancelled[oldest] >= now - _CANCEL_MEMORY_S:
                break
            del self._cancelled[oldest]
        self._cancelled[key] = now
        task = self._running_calls.get(key)
        if task is not None:
            task.cancel()
        async with self._changed:
            held = [job for job in self._queue if job.key == key]
            for job in held:  # pulled, not started: done with now
                self._queue.remove(job)
            if held:
                self._record()
                self._changed.notify_all()
        for job in held:
            await self._drop(job, "dropped_cancelled")

    async def _on_ping(self, msg: Any) -> None:
        await self._beat_safely()

    async def _beat_safely(self) -> None:
        try:
            await self._beat()
        except Exception:  # noqa: BLE001
            log.exception("worker %s: heartbeat", self.id)

    def health(self) -> tuple[bool, bool, str]:
        """(live, ready, why) for the probes of `serve_probes`: live unless the heartbeat loop has
        stopped turning (a wedged event loop); ready while it pulls: started, connected, not draining."""
        if not self.started.is_set():
            return True, False, "starting (loading preloads, or waiting for NATS)"
        silent = time.monotonic() - self._last_beat
        if silent > max(5.0, 5 * self.settings.heartbeat_s):
            return False, False, f"the heartbeat loop has not run for {silent:.0f} s"
        if self._draining:
            return True, False, "draining"
        if self._nc is None or not self._nc.is_connected:
            return True, False, "not connected to NATS"
        return True, True, "pulling"

    async def _heartbeats(self) -> None:
        while True:
            self._last_beat = time.monotonic()
            try:
                await self._beat()
            except Exception:  # noqa: BLE001 (a status that fails to build: the next beat may not)
                log.exception("worker %s: heartbeat", self.id)
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
            reply = p.RpcReply(worker=self.id, tokens=tokens)
        except Exception as exc:  # noqa: BLE001
            reply = p.RpcReply(worker=self.id, error=msgspec.structs.asdict(p.error_of(exc, None)))
        await msg.respond(msgspec.msgpack.encode(reply))


def serve_probes(worker: Worker, host: str, port: int):
    """A small HTTP server on its own thread: `/metrics` (Prometheus), `/healthz` (200 while the
    worker is live, else 503) and `/readyz` (200 while it pulls). Returns the server (`.shutdown()`)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                status, body, kind = 200, worker.metrics.exposition(), worker.metrics.content_type
            elif path in ("/healthz", "/readyz"):
                live, ready, why = worker.health()
                ok = live if path == "/healthz" else ready
                status, body, kind = (200 if ok else 503), (why + "\n").encode(), "text/plain; charset=utf-8"
            else:
                status, body, kind = 404, b"not found: /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="worker-probes", daemon=True).start()
    return server


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
