"""Payload offload: calls and results larger than the server's message limit (less the headroom
their headers need) travel through the NATS Object Store, bucket `shoal_payloads`, while in flight.

    gateway  call over the limit ─put_call─▶ "call-<key>"; the message is empty, Shoal-Object names it
    worker   read_object(call) ... result over the limit ─put─▶ "result-<key>"; the reply names it
    gateway  read_reply ─▶ delete_object (a call's object too, once answered or given up); a late or
             second reply's object is deleted unread. The bucket's TTL (`payload_ttl_s`) removes what a
             crash leaves.
"""

from __future__ import annotations

import asyncio
import io
import logging
from typing import Any

from ..errors import DeadlineExceeded, QueueUnavailable
from . import protocol as p

log = logging.getLogger("shoal.cluster")


def over_limit(data: bytes, max_payload: int, headroom_bytes: int) -> bool:
    """Whether `data` goes through the Object Store rather than in the message."""
    return len(data) > max_payload - headroom_bytes


async def read_object(store: Any, name: str) -> bytes:
    """An Object Store object's bytes (into a buffer: nats-py's default concatenates per chunk,
    quadratic in the object's size). No time limit of its own: callers bound it."""
    buffer = io.BytesIO()
    await store.get(name, writeinto=buffer)
    return buffer.getvalue()


async def put_call(store: Any, name: str, data: bytes, timeout_s: float, request_id: str) -> None:
    """The gateway's: a call's bytes into the bucket within `timeout_s` (the call's deadline), else
    DeadlineExceeded; QueueUnavailable (retryable) when NATS fails the put."""
    try:
        await asyncio.wait_for(store.put(name, data), timeout_s)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            "the request's deadline passed while its payload was stored",
            details={"phase": "queue", "request_id": request_id},
        ) from None
    except Exception as exc:  # broad: NATS gone mid-put, or anything else: a 503, never a 500
        p.log_swallowed(log, exc, "gateway: payload of request %s", request_id)
        raise QueueUnavailable(
            f"the payload store did not take the call ({type(exc).__name__}); retry shortly",
            retry_after_s=2.0,
            details={"request_id": request_id},
        ) from None


async def read_reply(store: Any, msg: Any, timeout_s: float) -> tuple[bytes, str | None]:
    """A reply's bytes (from the object its Shoal-Object header names, read within `timeout_s`),
    and that object's name (None: the bytes came in the message)."""
    name = msg.headers.get(p.OBJECT) if msg.headers else None
    if not name:
        return msg.data, None
    return await asyncio.wait_for(read_object(store, name), timeout_s), name


async def delete_object(store: Any, name: str) -> None:
    try:
        await store.delete(name)
    except p.nats_errors() as exc:  # deleted already, or NATS down: the bucket's TTL removes it
        log.debug("object %s not deleted: %r", name, exc)
