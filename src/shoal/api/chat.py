"""OpenAI's chat completions on a generating model (wire/openai_chat.py): one answer, or with
`stream` a server-sent event per step that gave new text, then `data: [DONE]`.

A streamed call's errors before its first token (a bad schema, a prompt past the context, an
unknown model) are the usual 4xx answers; an error after it is an `error` event, and the stream
ends. A client that goes away ends its generation (its KV cache slot is freed before the next step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec
from starlette.responses import StreamingResponse

from .. import wire
from ..calls import Generated, GenerateResult
from ..errors import InvalidRequest, ShoalError
from .routes import Context

log = logging.getLogger("shoal.api")
_HOLD = "\ufffd"  # a token that ends inside a character: its text waits for the next one


async def chat_completions(ctx: Context) -> wire.openai_chat.ChatResponse | StreamingResponse:
    req: wire.openai_chat.ChatRequest = ctx.decode(wire.openai_chat.ChatRequest)
    ctx.model = req.model
    call = wire.openai_chat.chat_call(req, ctx.request_id)
    if not req.stream:
        result: GenerateResult = await ctx.run(call)
        return wire.openai_chat.chat_response(req, result, ctx.request_id)
    stream = getattr(ctx.service, "stream", None)
    if stream is None:
        raise InvalidRequest("this server does not stream generations: send stream false")
    ctx.status(call.model)
    updates: AsyncGenerator[Generated | GenerateResult, None] = stream(
        msgspec.structs.replace(call, may_download=ctx.principal.may_download)
    )
    first = await anext(updates)  # errors before the first token are this request's answer
    return StreamingResponse(_events(req, call.stop, first, updates, ctx.request_id), media_type="text/event-stream")


async def _events(
    req: wire.openai_chat.ChatRequest,
    stop: list[str],
    first: Generated | GenerateResult,
    updates: AsyncGenerator[Generated | GenerateResult, None],
    request_id: str,
) -> AsyncIterator[bytes]:
    ident, created = wire.openai_chat.completion_id(request_id), int(time.time())
    chunk = wire.openai_chat.chat_chunk
    choice, delta = wire.openai_chat.ChunkChoice, wire.openai_chat.Delta
    sent = ""
    yield _event(chunk(ident, created, req.model, [choice(0, delta(role="assistant", content=""))]))
    try:
        item = first
        while not isinstance(item, GenerateResult):
            text = _sendable(item.text, stop)
            if len(text) > len(sent):
                yield _event(chunk(ident, created, req.model, [choice(0, delta(content=text[len(sent) :]))]))
                sent = text
            item = await anext(updates)
        rest = item.text[len(sent) :] if item.text.startswith(sent) else ""
        yield _event(chunk(ident, created, req.model, [choice(0, delta(content=rest or None), item.finish_reason)]))
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = wire.openai_chat.usage_of(item)
            yield _event(chunk(ident, created, req.model, [], usage=usage))
    except ShoalError as exc:
        body = {"error": {"message": exc.message, "type": exc.code, "code": exc.code}}
        yield b"data: " + msgspec.json.encode(body) + b"\n\n"
    except Exception:  # a bug: the client still gets an error event and the end of the stream
        log.exception("request %s: the chat stream failed", request_id)
        message = f"internal error (request id {request_id}); the server log has the traceback"
        yield (
            b"data: "
            + msgspec.json.encode({"error": {"message": message, "type": "internal", "code": "internal"}})
            + b"\n\n"
        )
    finally:
        await updates.aclose()  # a client that went away: the generation is cancelled
    yield b"data: [DONE]\n\n"


def _sendable(text: str, stop: list[str]) -> str:
    """The text that may go out now: not a character still incomplete, nor what could be the start
    of a stop string (the final text stops before it)."""
    text = text.rstrip(_HOLD)
    held = 0
    for s in stop:
        for n in range(min(len(s), len(text)), 0, -1):
            if text.endswith(s[:n]):
                held = max(held, n)
                break
    return text[: len(text) - held]


def _event(value: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(value) + b"\n\n"
