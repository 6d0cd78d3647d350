"""Pulling by capacity and by model affinity: one `Puller` per model asks its JetStream consumer
for the calls that fit the host's room, and puts them on the host queue.

    resident (a device has the model loaded), or model_affinity off:
    wait_for_room ─ reserve one call's worth ─ fetch(1, PULL_WAIT_S) ─ unreserve ─ take it ─ more
    cold (no device has it loaded):
    wait_cold ─ the host idle ≥ COLD_IDLE_S (looks every cold_pull_after_s while calls are queued),
              │ or busy with room (every ~COLD_PROBE_S) ─ look at the consumer: idle, calls that
              │ waited cold_pull_after_s? busy, calls nobody took since the last look?
              │ ─ a call queued now (no_wait) ─ take it ─ more
    more: reserve the room left for k calls of the model's mean size ─ fetch(k, MORE_WAIT_S)

- The tokens asked for are reserved until the pull returns, so the pullers of several models do
  not ask for the same room twice; with less than one call's worth unreserved, a puller asks for
  one call anyway (which may not fit: then it goes back).
- Affinity: JetStream hands a call to a waiting pull as it arrives. A worker with the model loaded
  keeps a pull waiting while it has room; a cold puller never waits for calls to come: it asks with
  `no_wait` for a call already queued, so it takes only what no worker with the model loaded asked
  for, and only once such calls have waited `cold_pull_after_s` (about a load's time: sooner, the
  workers that have the model would likely take them before a load ends). It looks at the
  consumer to tell (pending calls and deliveries: the calls queued at a look that long ago are not
  all delivered); with none queued, some unacked and none delivered meanwhile (handed back, due
  again with nobody asking), it asks too. It pays the load, then takes a batch's worth (the room)
  of the model's calls behind it. Only an idle host takes a load for calls that wait: a busy one
  with room looks about once a second and pulls only calls nobody takes at all (no delivery since
  its last look: a model loaded nowhere while every worker is busy), so no call waits for ever,
  and a fleet that is merely full does not trade loads.
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
import random
import time
from collections.abc import Mapping
from typing import Any

from ..config import ClusterSettings
from ..metrics import WorkerMetrics
from . import protocol as p
from .backlog import BacklogView
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
# The longest wait for the answer to a cold pull (no_wait: NATS answers at once, a call or none).
COLD_WAIT_S = 1.0
# An idle host that finds a cold model's queue empty looks less often, down to once in this long.
COLD_LOOK_MAX_S = 0.5
# A host is idle for a cold pull once idle this long: between one call and the next of its own
# models (a waiting pull's answer) it is idle for a few milliseconds.
COLD_IDLE_S = 0.05
# How often a busy host with room looks at a cold model's queue (± half, at random).
COLD_PROBE_S = 1.0


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
        backlog: BacklogView | None = None,
    ) -> None:
        self.model_id = model_id
        self.settings = settings
        self.queue = queue
        self.wm = wm
        self.worker_id = queue.worker_id
        self._nc = nc
        self._js = js
        self._cancelled = cancelled  # the worker's: call keys whose callers went away
        self._backlog = backlog  # the model's queue as the gateways publish it (cluster/backlog.py)
        self.max_deliver = settings.max_deliver  # the consumer's, as NATS has it (ensure_consumer reads it)
        self.mean_tokens: float | None = None
        self._sub: Any = None
        self._cold_inbox: Any = None  # where the answers to cold pulls come
        # Cold pulls (time.monotonic()): the next look at the queue while the host is idle (and the
        # interval between them) or busy with room, and the look compared with: (when, calls
        # queued, deliveries so far).
        self._idle_look_at = float("-inf")
        self._idle_interval_s = settings.cold_pull_after_s
        self._busy_look_at = time.monotonic() + COLD_PROBE_S * random.uniform(0.5, 1.5)
        self._looked: tuple[float, int, int] | None = None
        self._from_feed = False  # whether the last look read the backlog feed

    async def ensure_consumer(self) -> None:
        """The model's durable consumer, made if missing (setup, and after NATS lost its store)."""
        await p.ensure_consumer(self._js, self.settings, self.settings.pool, self.model_id)
        info = await self._js.consumer_info(p.STREAM, p.consumer_name(self.settings.pool, self.model_id))
        # The shared consumer's, which the last worker to start may have set: what NATS enforces.
        self.max_deliver = info.config.max_deliver or self.settings.max_deliver

    async def run(self) -> None:
        """Pulls until the host queue drains."""
        queue = self.queue
        self._sub = None
        while not queue.draining:
            try:
                mean = max(1.0, _FIRST_MEAN_TOKENS if self.mean_tokens is None else self.mean_tokens)
                if self.settings.model_affinity and not queue.resident(self.model_id):
                    await self._pull_cold(mean)
                else:
                    await self._pull(mean)
            except Exception as exc:  # broad: the puller outlives any failure (cut off, consumer lost with the store)
                log.warning(
                    "worker %s: pulling %s: %s; retrying",
                    self.worker_id,
                    self.model_id,
                    exc,
                    exc_info=not p.is_nats_error(exc),
                )
                self._sub = None
                await asyncio.sleep(0.5)
                if self._nc.is_connected:
                    try:
                        await self.ensure_consumer()
                    except Exception as again:  # broad: the puller must outlive any failure; the next turn tries again
                        p.log_swallowed(log, again, "worker %s: the consumer of %s", self.worker_id, self.model_id)

    async def _subscription(self) -> Any:
        if self._sub is None:
            self._sub = await self._js.pull_subscribe_bind(
                durable=p.consumer_name(self.settings.pool, self.model_id), stream=p.STREAM
            )
        return self._sub

    async def _fetch(self, batch: int, wait_s: float) -> list[Any]:
        """What `fetch` returns; nothing when nothing came in `wait_s`."""
        from nats.errors import TimeoutError as NatsTimeout

        sub = await self._subscription()
        try:
            msgs: list[Any] = await sub.fetch(batch, timeout=wait_s)
            return msgs
        except (NatsTimeout, asyncio.TimeoutError):
            return []

    async def _pull(self, mean: float) -> None:
        """One pull of a model the host has loaded (or of any, without affinity): wait for room."""
        reserved = await self.queue.wait_for_room(mean)
        if reserved is None:  # draining
            return
        try:
            # Wait for one call alone, then take at once what else is there and fits: nats-py's
            # fetch(n) may hold a call it has received until n have come or the pull expires.
            first = await self._fetch(1, PULL_WAIT_S)
        finally:
            await self.queue.unreserve(reserved)
        await self._take_all(first)
        if first:
            await self._pull_more(mean)

    async def _pull_cold(self, mean: float) -> None:
        """One turn of a model no device of the host has loaded (see the module docstring)."""
        queue = self.queue
        await self._take_late()
        turn = await queue.wait_cold(self.model_id, self._idle_look_at, self._busy_look_at, PULL_WAIT_S, COLD_IDLE_S)
        if turn is None or turn == "resident":
            return
        pull, pending = await self._look(busy=turn == "busy")
        now = time.monotonic()
        after_s = self.settings.cold_pull_after_s
        if turn == "busy":
            self._busy_look_at = now + COLD_PROBE_S * random.uniform(0.5, 1.5)
        elif pending:  # look again when those calls will have waited cold_pull_after_s
            self._idle_interval_s = after_s
            # Counts from the feed come every backlog_s: no sooner than the next ones.
            soonest = now + (self.settings.backlog_s / 2 if self._from_feed else 0.01)
            self._idle_look_at = max(soonest, self._looked[0] + after_s) if self._looked else now + after_s
        else:  # nothing queued: look less often the longer the host stays idle
            self._idle_interval_s = min(COLD_LOOK_MAX_S, 2 * self._idle_interval_s)
            self._idle_look_at = now + self._idle_interval_s
        if not pull:
            return
        async with queue.cold_lock:  # one cold model at a time: an idle host takes one load
            if turn == "idle" and (not queue.idle_for(COLD_IDLE_S) or queue.resident(self.model_id)):
                return  # another cold puller's calls came first, or the model is loaded now
            first = await self._fetch_queued()
            await self._take_all(first)
        if first:
            await self._pull_more(mean)

    async def _take_late(self) -> None:
        """Calls a pull of this puller's subscription delivered after its fetch gave up (`_pull_more`
        waits MORE_WAIT_S: a busy host reads the rest late). They wait, delivered and unacked, in the
        subscription's buffer, and only its next fetch reads them: a cold model's puller never
        fetches there (it pulls with no_wait through its own inbox, and NATS has nothing to hand it),
        so they would wait for ack_wait on an idle host. Take them now (or hand them back)."""
        sub = self._sub
        late = []
        while sub is not None and sub.pending_msgs:
            msg = await sub._sub.next_msg(timeout=COLD_WAIT_S)  # nats-py's buffer of the pull subscription
            if not (msg.headers and msg.headers.get("Status")):  # not a pull's status (404: no more)
                late.append(msg)
        await self._take_all(late)

    async def _look(self, busy: bool) -> tuple[bool, int]:
        """(whether to pull, the calls queued now), from the model's consumer (as the gateways last
        published it, or asked of JetStream when none did: cluster/backlog.py), against a look at
        least cold_pull_after_s before. An idle host pulls when the calls queued then were not all
        delivered since (JetStream delivers new calls in order: they have waited that long); a busy
        one only when none was delivered since (nobody takes them). Either pulls when none was
        queued either time, some are unacked and none was delivered since (a call handed back and
        due again, with nobody asking for it)."""
        seen = self._backlog.latest(self.model_id) if self._backlog is not None else None
        self._from_feed = seen is not None
        if seen is not None:  # the counts and when they came
            now, counts = seen
            pending, delivered, unacked = counts.pending, counts.delivered, counts.unacked
            self.wm.cold_looks.labels(self.model_id, "backlog").inc()
        else:  # no gateway publishes the backlog: one JetStream API request
            info = await self._js.consumer_info(p.STREAM, p.consumer_name(self.settings.pool, self.model_id))
            now = time.monotonic()
            pending, delivered = info.num_pending or 0, info.delivered.consumer_seq or 0
            unacked = info.num_ack_pending or 0
            self.wm.cold_looks.labels(self.model_id, "jetstream").inc()
        last = self._looked
        long_enough = last is not None and now - last[0] >= self.settings.cold_pull_after_s
        if last is None or long_enough or not pending:
            self._looked = (now, pending, delivered)  # else the older look stays the one to compare with
        if last is None or not long_enough:
            return False, pending
        undelivered = last[1] - (delivered - last[2])  # of the calls queued at the last look
        if pending:
            return (last[1] > 0 and (undelivered == last[1] if busy else undelivered > 0)), pending
        return (not last[1] and bool(unacked) and delivered == last[2]), 0

    async def _fetch_queued(self) -> list[Any]:
        """The model's next call if one is queued now, undelivered: a pull with `no_wait`, which never
        stands in line for calls still to come (those go to the pulls of workers with the model).
        Its answer (the call, or a status: 404 none queued) comes to this puller's own inbox; one
        that came late, after a wait gave up, is read first."""
        if self._cold_inbox is None:
            self._cold_inbox = await self._nc.subscribe(self._nc.new_inbox())
        inbox = self._cold_inbox
        found = []
        while inbox.pending_msgs:
            found.append(await inbox.next_msg(timeout=COLD_WAIT_S))
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{p.STREAM}.{p.consumer_name(self.settings.pool, self.model_id)}"
        await self._nc.publish(subject, b'{"batch":1,"no_wait":true}', reply=inbox.subject)
        try:
            found.append(await inbox.next_msg(timeout=COLD_WAIT_S))
        except asyncio.TimeoutError:
            pass
        return [msg for msg in found if not (msg.headers and msg.headers.get("Status"))]

    async def _pull_more(self, mean: float) -> None:
        """After a call: as many more as the room left holds, of what is queued now (MORE_WAIT_S)."""
        more, reserved = await self.queue.reserve_more(mean, MAX_FETCH)
        if more <= 0:
            return
        try:
            rest = await self._fetch(more, MORE_WAIT_S)
        except p.nats_errors() as exc:  # a status message
            log.debug("worker %s: pulling more of %s: %r", self.worker_id, self.model_id, exc)
            rest = []
        finally:
            await self.queue.unreserve(reserved)
        await self._take_all(rest)

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
