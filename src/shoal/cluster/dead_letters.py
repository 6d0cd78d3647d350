"""Dead letters: calls JetStream delivered `max_deliver` times without an ack (their workers died
or ran past `ack_wait` each time).

    JetStream ─max-deliveries advisory─▶ SHOAL_DEAD (stream) ─durable "gateways", shared─▶ one gateway
        ─ reads the call's headers from SHOAL_WORK by the advisory's stream sequence
        ─ answers its caller, on whichever gateway holds it (the reply subject is in the headers):
          502 dead_letter naming the request id; shoal_dead_letters_total{model}
        ─ deletes the call, then acks the advisory (unacked, it comes back to a gateway)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from .. import calls
from ..calls import ErrorResult
from ..errors import DeadLetter
from ..metrics import GatewayMetrics
from . import protocol as p

log = logging.getLogger("shoal.gateway")

# The shared durable consumer of SHOAL_DEAD.
DURABLE = "gateways"


async def read(nc: Any, js: Any, gm: GatewayMetrics, max_deliver: int, stopping: Callable[[], bool]) -> None:
    """Pulls max-deliveries advisories (shared by every gateway) and answers their callers, until
    `stopping()`."""
    from nats.errors import TimeoutError as NatsTimeout

    sub = None
    while not stopping():
        try:
            if sub is None:
                sub = await js.pull_subscribe(p.DEAD_SUBJECT, durable=DURABLE, stream=p.DEAD_STREAM)
            for msg in await sub.fetch(16, timeout=1.0):
                await answer(nc, js, msg, gm, max_deliver)
        except (NatsTimeout, asyncio.TimeoutError):
            continue
        except Exception as exc:  # broad: the reader outlives any failure (cut off; the stream being recreated)
            log.log(
                logging.DEBUG if p.is_nats_error(exc) else logging.WARNING,
                "gateway: dead letters: %r",
                exc,
                exc_info=not p.is_nats_error(exc),
            )
            sub = None
            await asyncio.sleep(1.0)


async def answer(nc: Any, js: Any, advisory: Any, gm: GatewayMetrics, max_deliver: int) -> None:
    """One advisory: the dead call's caller answered (502 dead_letter), the call deleted."""
    from nats.js.errors import NotFoundError

    try:
        event = json.loads(advisory.data)
        seq = int(event["stream_seq"])
    except (ValueError, KeyError, TypeError):
        log.warning("gateway: an unreadable max-deliveries advisory: %r", advisory.data[:200])
        await advisory.ack()
        return
    try:
        stored = await js.get_msg(p.STREAM, seq)
    except NotFoundError:  # deleted already: its caller gave up, or another gateway answered it
        await advisory.ack()
        return
    # Any other failure (NATS busy, cut off): unacked, the advisory comes back to a gateway.
    headers = stored.headers or {}
    request_id = headers.get(p.REQUEST_ID, "?")
    model_id = p.untoken(stored.subject.rsplit(".", 1)[-1])
    deliveries = event.get("deliveries", max_deliver)
    log.error(
        "dead letter: request %s for %s was delivered %s times without an answer", request_id, model_id, deliveries
    )
    gm.dead_letters.labels(model_id).inc()
    error = DeadLetter(
        f"request {request_id} was delivered to workers {deliveries} times and none answered "
        "(they died or ran past their time on it); it was not retried again",
        details={"request_id": request_id, "deliveries": deliveries},
    )
    if headers.get(p.REPLY):
        await nc.publish(headers[p.REPLY], calls.encode(ErrorResult.of(error, request_id)))
    try:
        await js.delete_msg(p.STREAM, seq)
    except p.nats_errors() as exc:  # gone already (its caller gave up), or cut off: the queue's max_age removes it
        log.debug("gateway: dead letter %s not deleted: %r", request_id, exc)
    await advisory.ack()
