"""Handlers of other servers' route shapes, for their clients: Infinity's rerank (on `/rerank`, beside
TEI's), vLLM's `/score`, and the Hugging Face Inference API's token and zero-shot classification
bodies (on `POST /`, beside TEI's). Their bodies may name no model: the body's `model` where it
has one, else `?model=`, the `X-Shoal-Model` header, else the server's default model for the verb.
"""

from __future__ import annotations

import asyncio

from .. import wire
from ..calls import ScoreResult
from ..errors import InvalidRequest
from . import routes
from .routes import Context

# The extract kinds that answer each Hugging Face task.
TOKEN_CLASSIFIERS = ("token_class", "gliner")
ZERO_SHOT = ("zero_shot",)


async def rerank(ctx: Context) -> list[wire.tei.Rank] | wire.infinity.RerankResponse:
    """`/rerank`: TEI's body (`texts`) gets TEI's list; Infinity's or vLLM's (`documents`) gets
    Infinity's results object."""
    fields = ctx.fields()
    if "documents" in fields and "texts" not in fields:
        return await infinity_rerank(ctx)
    if "texts" in fields and "documents" not in fields:
        return await routes.tei_rerank(ctx)
    if fields:
        raise InvalidRequest(
            "a /rerank body has `texts` (TEI's request, answered with a list) or `documents` (Infinity's "
            "and vLLM's, answered with `results`), one of them",
            details={"path": "$"},
        )
    return await routes.tei_rerank(ctx)  # not an object: TEI's decode says what is wrong with it


async def infinity_rerank(ctx: Context) -> wire.infinity.RerankResponse:
    req = ctx.decode(wire.infinity.RerankRequest)
    ctx.model = model = ctx.scoring_model(req.model)
    ctx.check_count(len(req.documents))
    result = await ctx.run(wire.infinity.score_call(req, model, ctx.request_id))
    return wire.infinity.rerank_response(req, model, result, ctx.request_id)


async def vllm_score(ctx: Context) -> wire.vllm.ScoreResponse:
    """vLLM's `/score`: pairs scored as calls of one query each, run side by side."""
    req = ctx.decode(wire.vllm.ScoreRequest)
    ctx.model = model = ctx.scoring_model(req.model)
    calls = wire.vllm.score_calls(req, model, ctx.request_id)
    ctx.check_count(sum(len(call.documents) for call in calls))
    tasks = [asyncio.ensure_future(ctx.run(call)) for call in calls]
    try:
        results: list[ScoreResult] = await asyncio.gather(*tasks)
    except BaseException:  # one failed (or this request was cancelled): the others' work is dropped
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their errors are this one's, not the log's
        raise
    return wire.vllm.score_response(model, results, ctx.request_id)


async def token_classification(ctx: Context) -> list[wire.hf.TokenEntity]:
    req = ctx.decode(wire.hf.TokenClassificationRequest)
    ctx.model = model = ctx.default_model("extract", kinds=TOKEN_CLASSIFIERS)
    result = await ctx.run(wire.hf.token_classification_call(req, model, ctx.request_id))
    return wire.hf.entities(req, result)


async def zero_shot_classification(ctx: Context) -> list[wire.hf.LabelScore]:
    req = ctx.decode(wire.hf.ZeroShotRequest)
    ctx.model = model = ctx.default_model("extract", kinds=ZERO_SHOT)
    result = await ctx.run(wire.hf.zero_shot_call(req, model, ctx.request_id))
    return wire.hf.labels(result)
