"""The host queue: calls a worker pulled for its host and no device has taken yet, and what each
device holds.

A worker serves one host with one engine per device. Pullers put calls here; a device with room
takes the next one, so work pulled for the host goes to whichever device frees up first without
going back through NATS:

    pullers ──put──▶ jobs (deque) ──take(device): room under its budget──▶ device 0 │ device 1 ...
                      │ in_progress() every ack_wait / 3 while they wait       └── release when answered
                      └ drop (ack: never run) / hand_back (nak: another worker takes it)

    budget(device) = prefetch_s × the device's tokens/s   (min_inflight_tokens before it has a rate)
    room           = Σ max(0, budget − held) over devices − tokens queued here
    idle           = nothing queued here and a device holds nothing (`idle_since`: from when)

Every count is in the gateway's token estimates. `changed` (one condition) guards the jobs, the
held tokens, the pullers' reservations and `draining`; whoever changes one notifies it.

A model is resident on the host when a device has it loaded. Pullers of the other models (cold
ones) look at their queue when `wait_cold` says (the host idle, or busy with room, and their time
come), and pull one at a time (`cold_lock`), so an idle host takes one model's load, not several.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import ClusterSettings
from ..errors import ShoalError
from ..metrics import WorkerMetrics
from ..service import Service
from . import protocol as p

log = logging.getLogger("shoal.worker")

# A measured device's budget never falls below this many tokens.
MIN_BUDGET_TOKENS = 256
# How many calls past the first a device looks at for one whose model it has loaded.
_SKIP_AHEAD = 15


@dataclass(eq=False)
class Job:
    """One pulled call, as its headers describe it (the body is read when a device runs it)."""

    msg: Any  # nats-py's JetStream message
    model_id: str
    tokens: int
    request_id: str  # the caller's (logs, error bodies): not unique
    key: str  # the gateway's unique id of the call (its Nats-Msg-Id): what a cancel names
    deadline: float  # unix seconds
    reply: str | None
    obj: str | None
    keep: bool  # no delivery left to spare: never hand it back


@dataclass(eq=False)
class Device:
    name: str
    service: Service
    held_tokens: int = 0
    running: set[asyncio.Task[None]] = field(default_factory=set)


class HostQueue:
    """The calls waiting on the host for a device, and the devices' share of the work (see the
    module docstring)."""

    def __init__(self, worker_id: str, devices: list[Device], settings: ClusterSettings, wm: WorkerMetrics) -> None:
        self.worker_id = worker_id
        self.devices = devices
        self.settings = settings
        self.wm = wm
        self.jobs: collections.deque[Job] = collections.deque()
        self.changed = asyncio.Condition()
        self.reserved = 0  # tokens pullers have asked NATS for and not yet received
        self.draining = False  # the worker is stopping: pullers stop
        self.idle_since: float | None = time.monotonic()  # since when the host is idle; None: busy
        self.cold_lock = asyncio.Lock()  # held by the one cold puller whose pull is out

    # --- capacity -------------------------------------------------------------------------------

    def budget(self, device: Device) -> int:
        """Tokens the device holds: `prefetch_s` of work at its measured rate (a slow device holds
        less), `min_inflight_tokens` until it has a rate. Shallow on purpose: what a device does not
        hold waits here for whichever device frees up first."""
        rate = device.service.capacity().tokens_per_s
        if not rate:
            return self.settings.min_inflight_tokens
        return max(MIN_BUDGET_TOKENS, int(rate * self.settings.prefetch_s))

    def held(self) -> int:
        return sum(job.tokens for job in self.jobs) + sum(d.held_tokens for d in self.devices)

    def room(self) -> int:
        """Tokens the host takes more of: each device's room under its budget (a device stuck over
        its own takes none of a sibling's), less what waits here for a device."""
        return sum(max(0, self.budget(d) - d.held_tokens) for d in self.devices) - sum(job.tokens for job in self.jobs)

    def idle_device(self) -> bool:
        """A device runs nothing and nothing waits for one: any call fits, however large."""
        return not self.jobs and any(not d.held_tokens for d in self.devices)

    def wants_work(self) -> bool:
        return self.room() > 0 or self.idle_device()

    def record(self) -> None:
        """After a change of the jobs or the held tokens: the gauges, and when the host went idle."""
        self.wm.held_tokens.set(self.held())
        self.wm.host_queue.set(len(self.jobs))
        if not self.idle_device():
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()

    def resident(self, model_id: str) -> bool:
        """A device of the host has the model loaded: its calls cost no load here."""
        return any(self._loaded(device, model_id) for device in self.devices)

    # --- the pullers' side ----------------------------------------------------------------------

    async def wait_for_room(self, mean_tokens: float) -> int | None:
        """Waits until the host wants work; then reserves one call's worth (`mean_tokens`) if that
        much room is unreserved, and returns the tokens reserved (0: it asks for one call anyway,
        which may not fit). None once draining."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.draining or self.wants_work())
            if self.draining:
                return None
            reserved = int(mean_tokens) if self.room() - self.reserved >= mean_tokens else 0
            self.reserved += reserved
            return reserved

    def idle_for(self, seconds: float) -> bool:
        """The host has been idle at least this long (not just between a call and the next)."""
        return self.idle_since is not None and time.monotonic() - self.idle_since >= seconds

    async def wait_cold(
        self, model_id: str, idle_at: float, busy_at: float, timeout_s: float, idle_s: float = 0.0
    ) -> str | None:
        """A cold puller's turn to look at its model's queue (times are `time.monotonic()`):

        - "resident": a device has loaded the model meanwhile (pull it as any other);
        - "idle": the host has been idle `idle_s` and `idle_at` has passed;
        - "busy": the host is busy but has room, and `busy_at` has passed;
        - None: `timeout_s` passed first, or the worker drains."""
        give_up = time.monotonic() + timeout_s
        async with self.changed:
            while not self.draining:
                if self.resident(model_id):
                    return "resident"
                now = time.monotonic()
                wake = give_up
                if self.idle_since is not None:
                    ready = max(idle_at, self.idle_since + idle_s)
                    if now >= ready:
                        return "idle"
                    wake = min(wake, ready)
                elif self.room() - self.reserved > 0:
                    if now >= busy_at:
                        return "busy"
                    wake = min(wake, busy_at)
                if now >= give_up:
                    return None
                try:
                    await asyncio.wait_for(self.changed.wait(), max(0.0, wake - now))
                except asyncio.TimeoutError:
                    pass
        return None

    async def reserve_more(self, mean_tokens: float, most: int) -> tuple[int, int]:
        """(calls, tokens reserved for them): as many calls of `mean_tokens` as the unreserved room
        holds now, at most `most`."""
        async with self.changed:
            more = int((self.room() - self.reserved) / mean_tokens)
            if more <= 0:
                return more, 0
            more = min(most, more)
            reserved = int(more * mean_tokens)
            self.reserved += reserved
            return more, reserved

    async def unreserve(self, tokens: int) -> None:
        async with self.changed:
            self.reserved -= tokens
            self.changed.notify_all()

    async def put(self, job: Job) -> None:
        async with self.changed:
            self.jobs.append(job)
            self.record()
            self.changed.notify_all()

    # --- the devices' side ----------------------------------------------------------------------

    async def take(self, device: Device) -> Job:
        """The next call for `device`, once it has one and room under its budget (a device holding
        nothing takes a call of any size); its tokens count as the device's until `release`."""
        async with self.changed:
            await self.changed.wait_for(
                lambda: self.jobs and (not device.held_tokens or device.held_tokens < self.budget(device))
            )
            job = self._pick(device)
            device.held_tokens += job.tokens
            self.record()
            self.changed.notify_all()  # the host queue shrank: a puller may take more
            return job

    async def release(self, device: Device, job: Job) -> None:
        async with self.changed:
            device.held_tokens -= job.tokens
            self.record()
            self.changed.notify_all()

    def _loaded(self, device: Device, model_id: str) -> bool:
        try:
            return device.service.model(model_id).loaded
        except ShoalError:
            return False

    def _pick(self, device: Device) -> Job:
        """The first queued call, unless another device has its model loaded (and will take it):
        then the first of the next few whose model this device has loaded. A single device, or a
        model loaded nowhere, keeps the queue's order (no call waits behind later ones)."""
        head = self.jobs[0]
        if (
            len(self.devices) > 1
            and not self._loaded(device, head.model_id)
            and any(self._loaded(other, head.model_id) for other in self.devices if other is not device)
        ):
            for index, job in enumerate(list(self.jobs)[1 : _SKIP_AHEAD + 1], start=1):
                if self._loaded(device, job.model_id):
                    del self.jobs[index]
                    return job
        return self.jobs.popleft()

    # --- the worker's side ----------------------------------------------------------------------

    async def start_draining(self) -> None:
        async with self.changed:
            self.draining = True
            self.changed.notify_all()  # pullers waiting for room stop waiting

    async def remove(self, which: Callable[[Job], bool]) -> list[Job]:
        """Takes the queued calls `which` picks out of the queue (none has started)."""
        async with self.changed:
            removed = [job for job in self.jobs if which(job)]
            for job in removed:
                self.jobs.remove(job)
            if removed:
                self.record()
                self.changed.notify_all()
        return removed

    async def keep_alive(self) -> None:
        """Calls waiting here for a device are kept from redelivery too (`in_progress()` every
        `ack_wait_s / 3`)."""
        while True:
            await asyncio.sleep(max(0.1, self.settings.ack_wait_s / 3))
            for job in list(self.jobs):
                try:
                    await job.msg.in_progress()
                except Exception as exc:  # broad: the loop keeps every other call alive; this one may be redelivered
                    p.log_swallowed(log, exc, "worker %s: in_progress of request %s", self.worker_id, job.request_id)

    # --- calls that leave unrun -----------------------------------------------------------------

    async def drop(self, job: Job, outcome: str) -> None:
        """Done with, never computed (its deadline passed, its caller went away): acked, so never
        redelivered."""
        await job.msg.ack()
        self.wm.calls.labels(job.model_id, outcome).inc()
        log.info("worker %s: request %s dropped unrun (%s)", self.worker_id, job.request_id, outcome)

    async def hand_back(self, job: Job, reason: str, delay: float | None = None) -> None:
        """Back to the work queue for another worker (`nak`, redelivered after `delay`)."""
        self.wm.naks.labels(job.model_id, reason).inc()
        try:
            await job.msg.nak(delay=delay)
        except p.nats_errors() as exc:  # cut off from NATS: it is redelivered after ack_wait anyway
            log.debug("worker %s: nak of request %s: %r", self.worker_id, job.request_id, exc)
