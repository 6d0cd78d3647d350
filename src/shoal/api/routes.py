"""Route handlers: thin module-level functions from a decoded wire request to a service call.

Each handler takes the request context and returns the response object; `endpoint` in
`shoal.api.app` reads the body, picks the formats, maps errors and records metrics once for all.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from .. import wire
from ..calls import EncodeCall, EncodeResult
from ..errors import InvalidRequest
from ..service import Service


@dataclass
class Context:
    request: Request
    service: Service
    body: bytes
    fmt_in: wire.Format
    max_items: int
    request_id: str
    model: str | None = None  # set once known, for metric labels
    result_bytes: int = 0  # array bytes in the response, to encode large ones off the event loop

    def decode(self, typ: type):
        return wire.decode(self.body, self.fmt_in, typ)

    def check_count(self, num_items: int) -> None:
        if num_items > self.max_items:
            raise InvalidRequest(
                f"{num_items} items in one request; the limit is {self.max_items}: split the request",
                details={"items": num_items, "max_items": self.max_items},
            )


async def encode(ctx: Context) -> wire.EncodeResponse:
    req: wire.EncodeRequest = ctx.decode(wire.EncodeRequest)
    ctx.model = req.model
    ctx.check_count(len(req.items))
    texts = [item.text for item in req.items]
    opts = req.options
    result: EncodeResult = await ctx.service.run(
        EncodeCall(
            model=req.model,
            texts=texts,
            normalize=opts.normalize,
            dimensions=opts.dimensions,
            output_dtype=opts.output_dtype,
            is_query=opts.is_query,
            prompt_name=opts.prompt_name,
            truncate=opts.truncate,
            outputs=tuple(opts.outputs) if opts.outputs else None,
            sparse_top_k=opts.sparse_top_k,
            return_tokens=opts.return_tokens,
            request_id=ctx.request_id,
            timeout_s=opts.timeout_s,
        )
    )
    ctx.result_bytes = _array_bytes(result)
    items = [_item(item.id, out) for item, out in zip(req.items, result.items)]
    return wire.EncodeResponse(
        model=req.model,
        items=items,
        usage=wire.Usage(tokens=result.num_tokens),
        timings=_timings(result),
    )


async def embeddings(ctx: Context) -> wire.EmbeddingsResponse:
    """OpenAI-compatible: the official client sends `encoding_format: base64` by default."""
    req: wire.EmbeddingsRequest = ctx.decode(wire.EmbeddingsRequest)
    ctx.model = req.model
    texts = req.texts()
    ctx.check_count(len(texts))
    result: EncodeResult = await ctx.service.run(
        EncodeCall(model=req.model, texts=texts, dimensions=req.dimensions, outputs=("dense",), request_id=ctx.request_id)
    )
    ctx.result_bytes = _array_bytes(result) * (1 if req.encoding_format == "base64" else 4)
    data = [wire.openai_embedding(i, v, req.encoding_format) for i, v in enumerate(result.vectors)]
    usage = wire.EmbeddingsUsage(prompt_tokens=result.num_tokens, total_tokens=result.num_tokens)
    return wire.EmbeddingsResponse(data=data, model=req.model, usage=usage)


async def models(ctx: Context) -> dict:
    data = []
    for status in ctx.service.models():
        data.append({
            "id": status.id,
            "object": "model",
            "owned_by": "shoal",
            "architecture": status.architecture,
            "tasks": list(status.tasks),
            "outputs": list(status.outputs),
            "dimensions": status.dimensions,
            "max_length": status.max_length,
            "pooling": status.pooling,
            "prompts": list(status.prompts),
            "verified": status.verified,
            "loaded": status.loaded,
            "description": status.description,
        })
    return {"object": "list", "data": data}


def _array_bytes(result: EncodeResult) -> int:
    if not result.items:
        return 0
    first = result.items[0]
    per_item = sum(a.nbytes for a in (first.dense, first.multivector) if a is not None)
    if first.sparse is not None:
        per_item += first.sparse.indices.nbytes * 2
    return per_item * len(result.items)


def _item(item_id, out) -> wire.EncodedItem:
    sparse = None
    if out.sparse is not None:
        sparse = wire.SparseOut(indices=out.sparse.indices, values=out.sparse.values, tokens=out.sparse.tokens)
    return wire.EncodedItem(id=item_id, dense=out.dense, sparse=sparse, multivector=out.multivector)


def _timings(result) -> wire.Timings:
    ms = 1000.0
    return wire.Timings(
        tokenize_ms=round(result.tokenize_s * ms, 3),
        queue_ms=round(result.queue_s * ms, 3),
        inference_ms=round(result.inference_s * ms, 3),
        total_ms=0.0,  # filled in by the endpoint, which sees the whole request
    )
