"""The work queue as JetStream sees it, on the gateway's /metrics: per consumer (pool and model),
the calls waiting to be delivered (`shoal_queue_pending_calls`) and those delivered to a worker and
not yet acked (`shoal_queue_unacked_calls`: running, or held on its host). What KEDA's
nats-jetstream trigger scales on, here for dashboards and the lag alert. Read every `POLL_S`
(one consumer-list request per 256 consumers); a consumer's series goes when its consumer does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..metrics import GatewayMetrics
from . import protocol as p

log = logging.getLogger("shoal.gateway")

# How often the queue gauges are read from JetStream.
POLL_S = 5.0


async def watch(js: Any, gm: GatewayMetrics, connected: Callable[[], bool]) -> None:
    """Keeps the queue gauges (while `connected()`; cut off, they keep their last values)."""
    shown: set[tuple[str, str]] = set()
    while True:
        if connected():
            try:
                seen = set()
                for info in await consumers(js):
                    labels = p.consumer_of(info.name)
                    if labels is None:
                        continue  # not one of shoal's
                    gm.queue_pending.labels(*labels).set(info.num_pending or 0)
                    gm.queue_unacked.labels(*labels).set(info.num_ack_pending or 0)
                    seen.add(labels)
                for labels in shown - seen:
                    gm.queue_pending.remove(*labels)
                    gm.queue_unacked.remove(*labels)
                shown = seen
            except Exception as exc:  # broad: the gauge loop must outlive any failure; the gauges keep their values
                p.log_swallowed(log, exc, "gateway: cannot read the queue's consumers")
        await asyncio.sleep(POLL_S)


async def consumers(js: Any) -> list[Any]:
    """Every consumer of the work stream (JetStream answers at most 256 per request)."""
    found: list[Any] = []
    while True:
        page = await js.consumers_info(p.STREAM, offset=len(found) or None)
        found += page
        if len(page) < 256:
            return found
