"""Control requests between a gateway and the workers, over core NATS request/reply on
`shoal.rpc.<action>.<pool>.<model>` (msgpack `RpcRequest` → `RpcReply`):

    admin     gateway ─publish to each pool serving the model─▶ every worker (each device's engine)
              ◀─ one inbox collects the replies (up to one per live holder) ─ statuses merged
    tokenize  gateway ─request─▶ one worker (queue group "tokenize"; its least busy device) ─▶ tokens
    detokenize  the same, token ids ─▶ texts

The gateway's side is `admin`, `tokenize` and `detokenize`; the worker's is `WorkerRpc`. Nothing here
imports torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ..calls import ErrorResult
from ..errors import NoWorker, ShoalError
from ..service import ModelStatus, Token
from . import protocol as p
from .directory import Holders, merge

if TYPE_CHECKING:
    from .host_queue import Device

log = logging.getLogger("shoal.cluster")


# --- the gateway's side -------------------------------------------------------------------------


async def admin(nc: Any, model_id: str, action: str, holders: Holders, timeout_s: float) -> ModelStatus:
    """The action on every live worker that serves the model (`holders`); the merged status after
    it. `timeout_s` bounds the wait for replies (a load may take the engine's load timeout)."""
    request = p.RpcRequest(model=model_id, action=action)
    replies = await _rpc_all(
        nc, "admin", model_id, request, len(holders), {beat.pool for beat, _ in holders}, timeout_s
    )
    statuses = [(None, reply.status) for reply in replies if reply.status is not None]
    errors = [reply.error for reply in replies if reply.error]
    if errors and not statuses:
        raise ErrorResult(**errors[0]).error()
    if not statuses:
        raise NoWorker(f"no worker answered for {model_id}; retry", retry_after_s=2.0)
    return merge(statuses)


async def tokenize(nc: Any, pool: str, request: p.RpcRequest, timeout_s: float) -> list[list[Token]]:
    """`request`'s texts as one worker of `pool` tokenizes them."""
    return (await _rpc_one(nc, "tokenize", pool, request, timeout_s)).tokens or []


async def detokenize(nc: Any, pool: str, request: p.RpcRequest, timeout_s: float) -> list[str]:
    """`request`'s token ids as one worker of `pool` decodes them."""
    return (await _rpc_one(nc, "detokenize", pool, request, timeout_s)).texts or []


async def _rpc_one(nc: Any, action: str, pool: str, request: p.RpcRequest, timeout_s: float) -> p.RpcReply:
    """One worker's reply; its error raised as itself."""
    subject = p.rpc_subject(action, pool, request.model)
    try:
        msg = await nc.request(subject, msgspec.msgpack.encode(request), timeout=timeout_s)
    except Exception as exc:  # broad: no responders, a timeout, cut off, anything: a 503, never a 500
        p.log_swallowed(log, exc, "gateway: %s for %s", action, request.model)
        raise NoWorker(
            f"no worker answered the {action} request for {request.model} ({type(exc).__name__}); retry",
            retry_after_s=2.0,
        ) from None
    reply = msgspec.msgpack.decode(msg.data, type=p.RpcReply)
    if reply.error:
        raise ErrorResult(**reply.error).error()
    return reply


async def _rpc_all(
    nc: Any, action: str, model_id: str, request: p.RpcRequest, expected: int, pools: set[str], timeout_s: float
) -> list[p.RpcReply]:
    """Send to every worker of `pools` serving the model; the replies of up to `expected` of them."""
    inbox = nc.new_inbox()
    replies: list[p.RpcReply] = []
    done = asyncio.Event()

    async def collect(msg: Any) -> None:
        replies.append(msgspec.msgpack.decode(msg.data, type=p.RpcReply))
        if len(replies) >= expected:
            done.set()

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        for pool in pools:
            await nc.publish(p.rpc_subject(action, pool, model_id), msgspec.msgpack.encode(request), reply=inbox)
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass  # a worker that did not answer in time: the others' replies stand
    finally:
        await sub.unsubscribe()
    return replies


# --- the worker's side --------------------------------------------------------------------------


class WorkerRpc:
    """A worker's answers to control requests, from its devices' services."""

    def __init__(self, worker_id: str, devices: Sequence[Device]) -> None:
        self.worker_id = worker_id
        self.devices = devices

    async def subscribe(self, nc: Any, pool: str, model_ids: list[str]) -> None:
        for model_id in model_ids:
            await nc.subscribe(p.rpc_subject("admin", pool, model_id), cb=self.on_admin)
            await nc.subscribe(p.rpc_subject("tokenize", pool, model_id), queue="tokenize", cb=self.on_tokenize)
            await nc.subscribe(p.rpc_subject("detokenize", pool, model_id), queue="tokenize", cb=self.on_detokenize)

    async def on_admin(self, msg: Any) -> None:
        request = msgspec.msgpack.decode(msg.data, type=p.RpcRequest)
        try:
            action = request.action or ""  # none named: the engine refuses it as an unknown action
            statuses = [await device.service.admin(request.model, action) for device in self.devices]
            reply = p.RpcReply(worker=self.worker_id, status=statuses[0])
        except Exception as exc:  # broad: whatever the engine raises is the caller's answer (a bug: a logged 500)
            reply = self._error(exc, "admin")
        await msg.respond(msgspec.msgpack.encode(reply))

    async def on_tokenize(self, msg: Any) -> None:
        request = msgspec.msgpack.decode(msg.data, type=p.RpcRequest)
        device = min(self.devices, key=lambda d: d.held_tokens)
        try:
            tokens = await device.service.tokenize(
                request.model,
                request.texts,
                request.add_special_tokens,
                request.prompt_name,
                may_download=request.may_download,
            )
            reply = p.RpcReply(worker=self.worker_id, tokens=tokens)
        except Exception as exc:  # broad: whatever the engine raises is the caller's answer (a bug: a logged 500)
            reply = self._error(exc, "tokenize")
        await msg.respond(msgspec.msgpack.encode(reply))

    async def on_detokenize(self, msg: Any) -> None:
        request = msgspec.msgpack.decode(msg.data, type=p.RpcRequest)
        device = min(self.devices, key=lambda d: d.held_tokens)
        try:
            texts = await device.service.detokenize(
                request.model, request.ids, request.skip_special_tokens, may_download=request.may_download
            )
            reply = p.RpcReply(worker=self.worker_id, texts=texts)
        except Exception as exc:  # broad: whatever the engine raises is the caller's answer (a bug: a logged 500)
            reply = self._error(exc, "detokenize")
        await msg.respond(msgspec.msgpack.encode(reply))

    def _error(self, exc: Exception, action: str) -> p.RpcReply:
        if not isinstance(exc, ShoalError):
            log.error("worker %s: %s failed", self.worker_id, action, exc_info=exc)
        return p.RpcReply(worker=self.worker_id, error=msgspec.structs.asdict(p.error_of(exc, None)))
