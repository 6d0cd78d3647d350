"""Pulling by capacity: one `Puller` per model asks its JetStream consumer for the calls that fit
the host's room, and puts them on the host queue.

    wait_for_room ─ reserve one call's worth ─ fetch(1, PULL_WAIT_S) ─ unreserve ─ take it
        └ then: reserve the room left for k more calls of the model's mean size ─ fetch(k, MORE_WAIT_S)

- The tokens asked for are reserved until the pull returns, so the pullers of several models do
  not ask for the same room twice; with less than one call's worth unreserved, a puller asks for
  one call anyway (which may not fit: then it goes back).
- A call is taken while the host has any room (as a device takes a call while under its budget),
  so a call a little over the room does not bounce. With no room at all it is `nak`ed with a delay
  doubling from `nak_delay_s` (at most 1 s), so another worker takes it, except from its
  one-before-last delivery on: one delivery always stays spare for a worker that dies (a nak never
  makes a dead letter).
- Sizes are the gateway's estimates (header `Shoal-Tokens`); the mean size per model is a moving
  average of the calls pulled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from ..config import ClusterSettings
from ..metrics import WorkerMetrics
from . import protocol as p
from .host_queue import HostQueue, Job

log = logging.getLogger("shoal.worker")

# How long one pull waits for calls before it checks for a drain or for room again.
PULL_WAIT_S = 1.0
# After the first call of a pull, how long it waits for the rest of what is already queued.
MORE_WAIT_S = 0.005
# Most calls asked for in one pull.
MAX_FETCH = 64
# The mean call size assumed before a model's first call, in tokens.
_FIRST_MEAN_TOKENS = 64.0


class Puller:
    """Pulls one model's calls (of the worker's pool) into the host queue (see the module docstring)."""

    def __init__(
        self,
        model_id: str,
        settings: ClusterSettings,
        nc: Any,
        js: Any,
        queue: HostQueue,
        wm: WorkerMetrics,
        cancelled: Mapping[str, float],
    ) -> None:
        self.model_id = model_id
        self.settings = settings
        self.queue = queue
        self.wm = wm
        self.worker_id = queue.worker_id
        self._nc = nc
        self._js = js
        self._cancelled = cancelled  # the worker's: call keys whose callers went away
        self.max_deliver = settings.max_deliver  # the consumer's, as NATS has it (ensure_consumer reads it)
        self.mean_tokens: float | None = None

    async def ensure_consumer(self) -> None:
        """The model's durable consumer, made if missing (setup, and after NATS lost its store)."""
        await p.ensure_consumer(self._js, self.settings, self.settings.pool, self.model_id)
        info = await self._js.consumer_info(p.STREAM, p.consumer_name(self.settings.pool, self.model_id))
        # The shared consumer's, which the last worker to start may have set: what NATS enforces.
        self.max_deliver = info.config.max_deliver or self.settings.max_deliver

    async def run(self) -> None:
        """Pulls until the host queue drains."""
        from nats.errors import TimeoutError as NatsTimeout

        queue = self.queue
        sub = None
        while not queue.draining:
            reserved = 0
            try:
                mean = max(1.0, _FIRST_MEAN_TOKENS if self.mean_tokens is None else self.mean_tokens)
                waited = await queue.wait_for_room(mean)
                if waited is None:  # draining
                    break
                reserved = waited
                if sub is None:
                    sub = await self._js.pull_subscribe_bind(
                        durable=p.consumer_name(self.settings.pool, self.model_id), stream=p.STREAM
                    )
                # Wait for one call alone, then take at once what else is there and fits: nats-py's
                # fetch(n) may hold a call it has received until n have come or the pull expires.
                try:
                    first = await sub.fetch(1, timeout=PULL_WAIT_S)
                except (NatsTimeout, asyncio.TimeoutError):
                    first = []
                await queue.unreserve(reserved)
                reserved = 0
                await self._take_all(first)
                if not first:
                    continue
                more, reserved = await queue.reserve_more(mean, MAX_FETCH)  # the room now, after the first call
                if more > 0:
                    try:
                        rest = await sub.fetch(more, timeout=MORE_WAIT_S)
                    except p.nats_errors() as exc:  # nothing more queued (a timeout), or a status message
                        log.debug("worker %s: pulling more of %s: %r", self.worker_id, self.model_id, exc)
                        rest = []
                    await queue.unreserve(reserved)
                    reserved = 0
                    await self._take_all(rest)
            except Exception as exc:  # broad: the puller outlives any failure (cut off, consumer lost with the store)
                log.warning(
                    "worker %s: pulling %s: %s; retrying",
                    self.worker_id,
                    self.model_id,
                    exc,
                    exc_info=not p.is_nats_error(exc),
                )
                sub = None
                await asyncio.sleep(0.5)
                if self._nc.is_connected:
                    try:
                        await self.ensure_consumer()
                    except Exception as again:  # broad: the puller must outlive any failure; the next turn tries again
                        p.log_swallowed(log, again, "worker %s: the consumer of %s", self.worker_id, self.model_id)
            finally:
                if reserved:
                    await queue.unreserve(reserved)

    async def _take_all(self, msgs: list[Any]) -> None:
        for msg in msgs:
            try:
                await self._take(msg)
            except Exception as exc:  # broad: one call's failure (closed connection, odd metadata) is not the others'
                log.warning(
                    "worker %s: could not take a call of %s: %s",
                    self.worker_id,
                    self.model_id,
                    exc,
                    exc_info=not p.is_nats_error(exc),
                )
                try:
                    await msg.nak()
                except p.nats_errors() as again:  # cut off: it is redelivered after ack_wait
                    log.debug("worker %s: nak of a call of %s: %r", self.worker_id, self.model_id, again)

    async def _take(self, msg: Any) -> None:
        headers = msg.headers or {}
        try:
            tokens = max(1, int(headers.get(p.TOKENS, "1")))
            deadline = float(headers.get(p.DEADLINE, "inf"))
        except ValueError:
            tokens, deadline = 1, float("inf")
        delivered = msg.metadata.num_delivered
        # One delivery stays spare for a crash: from the one before last, a call is never handed back.
        keep = delivered >= self.max_deliver - 1
        job = Job(
            msg,
            self.model_id,
            tokens,
            headers.get(p.REQUEST_ID, "?"),
            headers.get(p.MSG_ID, ""),
            deadline,
            headers.get(p.REPLY),
            headers.get(p.OBJECT),
            keep,
        )
        self.wm.pulled.labels(self.model_id).inc()
        if delivered > 1:
            self.wm.redelivered.labels(self.model_id).inc()
        mean = self.mean_tokens
        self.mean_tokens = tokens if mean is None else 0.9 * mean + 0.1 * tokens
        if job.key in self._cancelled:
            await self.queue.drop(job, "dropped_cancelled")
            return
        if self.queue.draining and not keep:
            await self.queue.hand_back(job, "drained")
            return
        if self.queue.room() <= 0 and not self.queue.idle_device() and not keep:
            # Later deliveries come back later.
            await self.queue.hand_back(job, "over_pulled", min(1.0, self.settings.nak_delay_s * 2 ** (delivered - 1)))
            return
        await self.queue.put(job)
