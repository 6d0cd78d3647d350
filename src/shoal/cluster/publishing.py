"""Publishing: a call's life in the JetStream work stream, as the gateway sees it (the workers'
side is `pulling`).

    publish ─ JetStream acks it: stored, at a stream sequence ─ await_reply: a worker's reply on the
        │   gateway's inbox, until the call's deadline and a grace
        ├ the ack lost: sent again with the same Nats-Msg-Id (the stream keeps one copy), while
        │   time is left; no ack at all: 503 queue_unavailable
        ├ given up (deadline, client gone): `abandon` deletes it from the stream (no worker has it
        │   yet) and broadcasts its key on shoal.cancel (the worker that has it drops it)
        └ NATS reconnected: replies travel on core NATS, so one sent meanwhile is lost; `recheck`
          fails, retryably, each call no longer in the stream (acked: answered) whose reply has not
          come, instead of letting it wait out its deadline
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..config import ClusterSettings
from ..errors import DeadlineExceeded, QueueUnavailable
from . import protocol as p

log = logging.getLogger("shoal.gateway")

# How long past a call's deadline the gateway still waits for a reply it may be computing.
REPLY_GRACE_S = 2.0


def time_left_s(deadline: float) -> float:
    """Seconds until `deadline` (`time.monotonic()`), at least a millisecond."""
    return max(0.001, deadline - time.monotonic())


async def publish(
    js: Any,
    cluster: ClusterSettings,
    subject: str,
    data: bytes,
    headers: dict[str, str],
    deadline: float,
    request_id: str,
    connected: Callable[[], bool],
) -> int:
    """The call's stream sequence once JetStream has stored it. A publish whose ack is lost is
    sent again with the same Nats-Msg-Id (the stream keeps one copy), while time is left."""
    for _ in range(3):
        try:
            ack = await js.publish(
                subject,
                data,
                headers=headers,
                timeout=min(cluster.publish_timeout_s, time_left_s(deadline)),
            )
            return int(ack.seq)
        except Exception as exc:  # broad: a timeout, no responders, cut off, a bad ack: a 503, never a 500
            p.log_swallowed(log, exc, "gateway: publish of request %s", request_id)
            error = exc
            if not connected() or time_left_s(deadline) < 0.05:
                break
    raise QueueUnavailable(
        f"the work queue did not take the call ({type(error).__name__}); retry shortly",
        retry_after_s=2.0,
        details={"request_id": request_id},
    )


async def await_reply(future: asyncio.Future[Any], deadline: float, request_id: str) -> Any:
    """The worker's reply message (what settles `future`), awaited until `deadline` plus
    REPLY_GRACE_S; DeadlineExceeded after that."""
    try:
        return await asyncio.wait_for(asyncio.shield(future), time_left_s(deadline) + REPLY_GRACE_S)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            "the request's deadline passed before a worker answered (phase: queue); retry later or with "
            "a longer timeout_s",
            details={"phase": "queue", "request_id": request_id},
        ) from None


async def recheck(
    js: Any,
    sequences: Mapping[str, int],
    pending: Mapping[str, asyncio.Future[Any]],
    stopping: Callable[[], bool],
) -> None:
    """After a reconnect: fail each call of `sequences` (call key -> its stream sequence) that is no
    longer in the stream while its future in `pending` is still unanswered; calls still in the
    stream are still to be answered."""
    from nats.js.errors import NotFoundError

    await asyncio.sleep(0.5)  # replies sent just before the acks we are about to miss arrive first
    for key, seq in list(sequences.items()):
        future = pending.get(key)
        for attempt in range(5):
            if future is None or future.done() or stopping():
                break
            try:
                await js.get_msg(p.STREAM, seq)
                break  # still in the stream: still to be answered
            except NotFoundError as exc:
                if getattr(exc, "err_code", None) != 10037:  # not "no message found" (the stream itself?)
                    await asyncio.sleep(0.5 * (attempt + 1))
                    continue
                if not future.done():
                    future.set_exception(
                        QueueUnavailable(
                            "the gateway lost its connection to NATS while the call ran, and its answer with it; retry",
                            retry_after_s=1.0,
                        )
                    )
                break
            except p.nats_errors() as exc:  # JetStream still starting: try again shortly
                log.debug("gateway: rechecking call %s: %r", key, exc)
                await asyncio.sleep(0.5 * (attempt + 1))


async def abandon(js: Any, nc: Any, seq: int | None, key: str) -> None:
    """A call nobody waits for: out of the queue if no worker has it, dropped by the one that
    does (cancels name the gateway's unique key of the call, never the caller's request id)."""
    if seq is not None:
        try:
            await js.delete_msg(p.STREAM, seq)
        except p.nats_errors() as exc:  # gone already once a worker acked it; cut off: the cancel still tries
            log.debug("gateway: call %s not deleted from the queue: %r", key, exc)
    try:
        await nc.publish(p.CANCEL_SUBJECT, key.encode())
    except p.nats_errors() as exc:  # cut off: the worker finds the deadline passed instead
        log.debug("gateway: cancel of call %s not sent: %r", key, exc)
