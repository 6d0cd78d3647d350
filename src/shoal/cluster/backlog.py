"""The queue's backlog per model, read once for the fleet: a gateway reads the work stream's
consumers every `backlog_s` and publishes, per pool, each model's calls queued, delivered so far
and unacked; a worker reads that instead of asking JetStream itself.

    gateway: publish ─ every backlog_s (x1-1.5, at random) ─ consumers_info (one request per 256)
                      ─▶ shoal.backlog.<pool> (core NATS): {model: (pending, delivered, unacked)}
    worker:  BacklogView ─ the latest counts per model of its pool, and when they came

Why: a worker with a model no device of its host has loaded looks at that model's queue before it
pulls a call of it (cluster/pulling.py), every cold_pull_after_s while idle. Asked of JetStream,
each look is one API request, and JetStream answers its API one request at a time: at 1,000 idle
workers over six models the looks alone took half of it (bench/cluster_sim.py). From this feed the
fleet costs JetStream one request per `backlog_s`, whatever its size.

With several gateways, a gateway that heard another's backlog within the last `backlog_s` skips its
turn, so about one publishes. A worker whose counts are older than `STALE_AFTER` periods (its own
or the publisher's, the longer; no gateway publishes: none runs, or it has `backlog_s` 0) asks
JetStream as before.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from . import protocol as p
from .queue_gauges import consumers

log = logging.getLogger("shoal.cluster")

# A worker's counts older than this many backlog periods are not used (it asks JetStream).
STALE_AFTER = 3.0


class Counts(msgspec.Struct, frozen=True, array_like=True):
    """One consumer's counts, as JetStream's consumer info has them."""

    pending: int  # queued, not yet delivered
    delivered: int  # deliveries so far (the consumer's sequence)
    unacked: int  # delivered, not yet acked


class Backlog(msgspec.Struct, frozen=True):
    """A pool's consumers' counts, by model id, and the gateway that read them."""

    gateway: str
    models: dict[str, Counts]
    every_s: float = 0.0  # the publisher's period (a worker's counts are stale after STALE_AFTER of it)


def subject(pool: str) -> str:
    return f"{p.BACKLOG_PREFIX}.{p.token(pool)}"


async def publish(nc: Any, js: Any, gateway_id: str, every_s: float, connected: Callable[[], bool]) -> None:
    """The gateway's loop (see the module docstring); `every_s` 0: it never publishes."""
    if every_s <= 0:
        return
    heard = [float("-inf")]  # when another gateway's backlog last came

    async def on_backlog(msg: Any) -> None:
        try:
            if msgspec.msgpack.decode(msg.data, type=Backlog).gateway != gateway_id:
                heard[0] = time.monotonic()
        except msgspec.DecodeError:
            log.debug("gateway: an unreadable backlog on %s", msg.subject)

    await nc.subscribe(f"{p.BACKLOG_PREFIX}.>", cb=on_backlog)
    while True:
        await asyncio.sleep(every_s * random.uniform(1.0, 1.5))
        if not connected() or time.monotonic() - heard[0] < every_s:
            continue
        try:
            pools: dict[str, dict[str, Counts]] = {}
            for info in await consumers(js):
                labels = p.consumer_of(info.name)
                if labels is None:
                    continue  # not one of shoal's
                pools.setdefault(labels[0], {})[labels[1]] = Counts(
                    info.num_pending or 0, info.delivered.consumer_seq or 0, info.num_ack_pending or 0
                )
            for pool, models in pools.items():
                await nc.publish(subject(pool), msgspec.msgpack.encode(Backlog(gateway_id, models, every_s)))
        except Exception as exc:  # broad: the loop must outlive any failure; workers ask JetStream meanwhile
            p.log_swallowed(log, exc, "gateway: cannot read or publish the queue's backlog")


class BacklogView:
    """A worker's view of its pool's backlog: `latest(model)` is (when it came, its counts), or
    None when no gateway published it within `STALE_AFTER` periods."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s  # the worker's setting; a publisher's own period, when longer, counts
        self._seen: dict[str, tuple[float, Counts, float]] = {}  # model -> (came, counts, max age)

    async def subscribe(self, nc: Any, pool: str) -> None:
        if self.every_s > 0:
            await nc.subscribe(subject(pool), cb=self._on_backlog)

    async def _on_backlog(self, msg: Any) -> None:
        try:
            backlog = msgspec.msgpack.decode(msg.data, type=Backlog)
        except msgspec.DecodeError:
            log.debug("worker: an unreadable backlog on %s", msg.subject)
            return
        now = time.monotonic()
        max_age_s = STALE_AFTER * max(self.every_s, backlog.every_s)
        for model_id, counts in backlog.models.items():
            self._seen[model_id] = (now, counts, max_age_s)

    def latest(self, model_id: str) -> tuple[float, Counts] | None:
        seen = self._seen.get(model_id)
        if seen is None or time.monotonic() - seen[0] > seen[2]:
            return None
        return seen[0], seen[1]
