"""`Worker`: engines without HTTP that pull calls from the cluster's work queue.

One worker process serves one host: one `Service` (an in-process Engine) per device, and one
host-local queue they share.

    JetStream consumer per model ──pull (sized by free capacity)──▶ host queue ──▶ device 0 engine
                                  ◀─nak(delay): what it over-pulled          └──▶ device 1 engine

- **Each call**: dropped unrun if its deadline has passed or its caller went away (`shoal.cancel`);
  else run by the device's engine (which forms the batches) with the time left as its timeout,
  `in_progress()` sent every `ack_wait_s / 3` while it runs; then the result (or error) is sent to
  the caller's reply subject (through the Object Store when larger than the message limit), and
  only then the message acked. A worker that dies before the ack leaves it to be redelivered.
  A generation whose gateway streams it (the `Shoal-Progress` header) also sends each update to
  the reply subject as it comes, before its answer.
- **SIGTERM drains**: stop pulling, hand back (nak) what is queued on the host, finish and answer
  what runs, ack, say `draining` in a last heartbeat, exit.

Its other jobs each have a module: `pulling` (a puller per model, sized by the host's room, by
model affinity),
`host_queue` (the calls pulled and not yet on a device; the devices' budgets), `probes`
(heartbeats, liveness, the HTTP probes), `rpc` (admin and (de)tokenize requests), `payloads` (the
Object Store).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import msgspec

from .. import calls
from ..config import ClusterSettings
from ..errors import InvalidRequest, ShoalError
from ..metrics import Metrics, WorkerMetrics
from ..service import Service
from . import payloads
from . import protocol as p
from .backlog import BacklogView
from .host_queue import MIN_BUDGET_TOKENS, Device, HostQueue, Job
from .nats_auth import connect_options
from .probes import Heartbeats, health, serve_probes
from .pulling import MAX_FETCH, MORE_WAIT_S, PULL_WAIT_S, Puller
from .rpc import WorkerRpc

__all__ = ["MAX_FETCH", "MIN_BUDGET_TOKENS", "MORE_WAIT_S", "PULL_WAIT_S", "Worker", "WorkerMetrics", "serve_probes"]

log = logging.getLogger("shoal.worker")

# Request ids cancelled recently (a worker may pull the call after the cancel was broadcast).
_CANCEL_MEMORY_S = 600.0


class Worker:
    """Pulls the calls of the models `services` serve (every service has the same catalog) and runs them."""

    def __init__(
        self,
        services: list[Service],
        settings: ClusterSettings,
        *,
        devices: list[str] | None = None,
        metrics: Metrics | None = None,
        worker_id: str | None = None,
        preload: tuple[str, ...] = (),
    ) -> None:
        if not services:
            raise InvalidRequest("a worker needs at least one device")
        connect_options(settings)  # a ConfigError now (a missing file, a user without password), not at connect
        self.settings = settings
        self.metrics = metrics or services[0].metrics
        self.wm = WorkerMetrics(self.metrics.registry)
        names = devices or [f"device{i}" for i in range(len(services))]
        self.devices = [Device(name, service) for name, service in zip(names, services)]
        self.wm.start_models(self.model_ids)
        self.host = socket.gethostname()
        self.id = worker_id or f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.preload = preload
        self.queue = HostQueue(self.id, self.devices, settings, self.wm)
        self.beats = Heartbeats(self.id, self.host, settings, self.queue)
        self.backlog = BacklogView(settings.backlog_s)  # each model's queue, as the gateways publish it
        self._cancelled: dict[str, float] = {}  # call key -> when (insertion order is time order)
        self._running_calls: dict[str, asyncio.Task[Any]] = {}  # call key -> its engine task (to cancel)
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.pullers: dict[str, Puller] = {}
        self._pulling: list[asyncio.Task[None]] = []
        self.started = asyncio.Event()  # set once it pulls
        # How long a drain waits for running calls (past it they are left to be redelivered).
        self.drain_timeout_s = 120.0

    @property
    def model_ids(self) -> list[str]:
        return [status.id for status in self.devices[0].service.models()]

    @property
    def draining(self) -> bool:
        return self.queue.draining

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def health(self) -> tuple[bool, bool, str]:
        """(live, ready, why) for the probes of `serve_probes` (see `probes.health`)."""
        return health(self)

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
        self._nc = await p.connect(
            self.settings,
            f"shoal-worker {self.id}",
            on_reconnect=self._on_reconnect,
            quiet=lambda: self._closing,
        )
        self._js = self._nc.jetstream()
        await self.backlog.subscribe(self._nc, self.settings.pool)
        self.pullers = {
            model_id: Puller(
                model_id, self.settings, self._nc, self._js, self.queue, self.wm, self._cancelled, self.backlog
            )
            for model_id in self.model_ids
        }
        await self._setup()
        await self._nc.subscribe(p.CANCEL_SUBJECT, cb=self._on_cancel)
        await self._nc.subscribe(p.PING_SUBJECT, cb=self._on_ping)
        await WorkerRpc(self.id, self.devices).subscribe(self._nc, self.settings.pool, self.model_ids)
        self._tasks.append(self._task(self.beats.run(self._nc), "worker-heartbeats"))
        self._tasks.append(self._task(self.queue.keep_alive(), "worker-keep-alive"))
        for device in self.devices:
            self._tasks.append(self._task(self._device_loop(device), f"worker-{device.name}"))
        self._pulling = [self._task(puller.run(), f"pull {model_id}") for model_id, puller in self.pullers.items()]
        self.started.set()
        log.info(
            "worker %s: pulling %d models on %s from %s (pool %s)",
            self.id,
            len(self._pulling),
            ", ".join(d.name for d in self.devices),
            p.redact(self.settings.nats_url),
            self.settings.pool,
        )

    def _task(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A loop that runs until the drain; one that dies of an error says so in the log."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._log_death)
        return task

    def _log_death(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("worker %s: %s stopped", self.id, task.get_name(), exc_info=task.exception())

    async def drain(self) -> None:
        log.info("worker %s: draining", self.id)
        await self.queue.start_draining()
        await self.beats.send(self._nc)
        await asyncio.gather(*self._pulling, return_exceptions=True)  # each returns after its current pull
        # Hand back what no device started (a sibling takes it now), except calls with no delivery
        # to spare: a nak would make them dead letters, so the devices run them.
        for job in await self.queue.remove(lambda job: not job.keep):
            await self.queue.hand_back(job, "drained")
        deadline = time.monotonic() + self.drain_timeout_s
        while self.queue.jobs or any(device.running for device in self.devices):
            if time.monotonic() > deadline:
                log.warning(
                    "worker %s: calls still running after %.0f s of drain; leaving them to be redelivered",
                    self.id,
                    self.drain_timeout_s,
                )
                break
            running = [task for device in self.devices for task in device.running]
            if running:
                await asyncio.wait(running, timeout=max(0.01, deadline - time.monotonic()))
            else:
                await asyncio.sleep(0.05)
        await self.beats.send(self._nc)
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
                for puller in self.pullers.values():
                    await puller.ensure_consumer()
                self._store = await self._js.object_store(p.PAYLOADS)
                return
            except Exception as exc:  # broad: retried until it works (JetStream not ready yet)
                log.warning(
                    "worker %s: cannot set up the work queue yet (%s); retrying",
                    self.id,
                    exc,
                    exc_info=not p.is_nats_error(exc),
                )
                await asyncio.sleep(0.5)

    async def _on_reconnect(self) -> None:
        self._spawn(self._setup())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A background task, referenced until done (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- devices --------------------------------------------------------------------------------

    async def _device_loop(self, device: Device) -> None:
        while True:
            try:
                job = await self.queue.take(device)
            except Exception:  # broad: a service's capacity() or model() failing must not stop the device serving
                log.exception("worker %s: %s could not take a call", self.id, device.name)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._run(device, job), name=f"call {job.request_id}")
            device.running.add(task)
            task.add_done_callback(device.running.discard)

    async def _run(self, device: Device, job: Job) -> None:
        try:
            await self._serve(device, job)
        except Exception:  # broad: never kill the device's loop; the message is redelivered
            log.exception("worker %s: request %s failed outside its engine", self.id, job.request_id)
        finally:
            await self.queue.release(device, job)

    async def _serve(self, device: Device, job: Job) -> None:
        if job.key in self._cancelled:
            await self.queue.drop(job, "dropped_cancelled")
            return
        if job.deadline - p.now() <= 0:
            await self.queue.drop(job, "dropped_deadline")
            return
        try:
            data = job.msg.data
            if job.obj:
                data = await asyncio.wait_for(
                    payloads.read_object(self._store, job.obj), max(0.01, job.deadline - p.now())
                )
            call = calls.decode_call(data)
        except asyncio.TimeoutError:
            await self.queue.drop(job, "dropped_deadline")
            return
        except Exception as exc:  # broad: its object gone, or bytes no decoder reads (which may raise anything)
            log.warning(
                "worker %s: request %s could not be read: %r",
                self.id,
                job.request_id,
                exc,
                exc_info=not isinstance(exc, (msgspec.DecodeError, *p.nats_errors())),
            )
            unread = p.error_of(InvalidRequest(f"the worker could not read the call: {exc}"), job.request_id)
            await self._reply(job, unread)
            await job.msg.term()  # answered: never retried
            return
        remaining = job.deadline - p.now()
        if job.key in self._cancelled or remaining <= 0:  # while its object was read
            await self.queue.drop(job, "dropped_cancelled" if job.key in self._cancelled else "dropped_deadline")
            return
        call = msgspec.structs.replace(call, timeout_s=remaining, request_id=job.request_id)
        keep_alive = asyncio.create_task(self._keep_alive(job))
        task = asyncio.create_task(self._compute(device.service, call, job))
        self._running_calls[job.key] = task
        try:
            result = await task
            outcome = "ok"
        except asyncio.CancelledError:
            if job.key in self._cancelled and task.cancelled() and not _cancelling():
                await self.queue.drop(job, "dropped_cancelled")
                return
            raise
        except Exception as exc:  # broad: whatever the engine raises is the caller's answer (a bug: a logged 500)
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

    def _compute(self, service: Service, call: calls.AnyCall, job: Job) -> Coroutine[Any, Any, calls.AnyResult]:
        """The call on its device's service; a generation the gateway streams is run as a stream."""
        stream = getattr(service, "stream", None)
        wants = job.reply and (job.msg.headers or {}).get(p.PROGRESS) == "1"
        if not (wants and stream is not None and isinstance(call, calls.GenerateCall)):
            return service.run(call)
        return self._streamed(stream(call), job)

    async def _streamed(self, updates: Any, job: Job) -> calls.AnyResult:
        """Each update of a generation to the reply subject as it comes (core NATS, as the answer:
        the two arrive in order), then its result, which `_serve` sends as any answer. An update
        over the message limit is skipped: the next one, or the answer, carries the whole text."""
        assert job.reply is not None
        try:
            async for item in updates:
                if isinstance(item, calls.GenerateResult):
                    return item
                data = p.encode_progress(item)
                if payloads.over_limit(data, self._nc.max_payload, self.settings.payload_headroom_bytes):
                    continue
                try:
                    await self._nc.publish(job.reply, data, headers={p.PROGRESS: "1"})
                except Exception as exc:  # broad: progress is best effort; the answer still goes
                    p.log_swallowed(log, exc, "worker %s: progress of request %s", self.id, job.request_id)
        finally:
            await updates.aclose()
        raise ShoalError(f"the generation of request {job.request_id} ended without its result")

    async def _keep_alive(self, job: Job) -> None:
        while True:
            await asyncio.sleep(max(0.1, self.settings.ack_wait_s / 3))
            try:
                await job.msg.in_progress()
            except Exception as exc:  # broad: the keep-alive must outlive any one failure; the call may be redelivered
                p.log_swallowed(log, exc, "worker %s: in_progress of request %s", self.id, job.request_id)

    async def _reply(self, job: Job, result: Any) -> None:
        if not job.reply:
            return
        data = calls.encode(result)
        headers = None
        if payloads.over_limit(data, self._nc.max_payload, self.settings.payload_headroom_bytes):
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
        for job in await self.queue.remove(lambda job: job.key == key):  # pulled, not started: done with now
            await self.queue.drop(job, "dropped_cancelled")

    async def _on_ping(self, msg: Any) -> None:
        await self.beats.send(self._nc)


async def _close(nc: Any) -> None:
    """Flush what is sent (replies, acks), then close (no reconnect attempts, no callbacks)."""
    try:
        await asyncio.wait_for(nc.flush(), 5.0)
    except p.nats_errors() as exc:  # NATS gone: unacked calls are redelivered
        log.debug("worker: flush before close: %r", exc)
    await nc.close()


def _cancelling() -> bool:
    """Whether the current task itself is being cancelled (a drain or shutdown, not a call's cancel)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())
