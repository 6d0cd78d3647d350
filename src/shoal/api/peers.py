"""Handlers of other servers' route shapes, for their clients: Infinity's rerank (on `/rerank`, beside
TEI's) and `/classify`, vLLM's `/score`, and the Hugging Face Inference API's token, zero-shot and
text classification bodies (on `POST /`, beside TEI's). Their bodies may name no model: the body's
`model` where it has one, else `?model=`, the `X-Shoal-Model` header, else the server's default
model for the verb.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from .. import wire
from ..errors import InvalidRequest
from . import routes
from .routes import Context

# The extract kinds that answer each Hugging Face task.
TOKEN_CLASSIFIERS = ("token_class", "gliner")
ZERO_SHOT = tuple(wire.hf.ZERO_SHOT_CALLS)  # NLI, GLiClass and GLiNER2
CLASSIFIERS = ("classify",)

T = TypeVar("T")


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
    results = await run_together([ctx.run(call) for call in calls])
    return wire.vllm.score_response(model, results, ctx.request_id)


async def run_together(runs: Sequence[Awaitable[T]]) -> list[T]:
    """The results of `runs` (a request's `ctx.run` of each of its calls), run side by side; the
    first error is the request's."""
    tasks = [asyncio.ensure_future(run) for run in runs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:  # one failed (or this request was cancelled): the others' work is dropped
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their errors are this one's, not the log's
        raise


def classifier(ctx: Context, named: str | None = None) -> str:
    """The text classifier (extract kind classify) a classification route uses: the body's model,
    `?model=`, `X-Shoal-Model`, else the default one; a model of another kind is a 400 saying what
    it serves."""
    return model_of_kinds(ctx, named, CLASSIFIERS, "a text classifier")


def model_of_kinds(ctx: Context, named: str | None, kinds: tuple[str, ...], what: str) -> str:
    """The model a route that only `kinds` of extract models serve uses (as `classifier`); one of
    another kind is a 400 saying what it serves."""
    model = ctx.default_model("extract", named, kinds=kinds)
    status = ctx.status(model)
    if status.extract not in kinds:
        serves = ", ".join(status.tasks) + (f" (extract kind {status.extract})" if status.extract else "")
        raise InvalidRequest(
            f"model {status.id} is not {what} (extract kind {_either(kinds)}); it serves: {serves}",
            details={"model": status.id, "kinds": list(kinds)},
        )
    return model


def _either(kinds: tuple[str, ...]) -> str:
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


async def infinity_classify(ctx: Context) -> wire.infinity.ClassifyResponse:
    req = ctx.decode(wire.infinity.ClassifyRequest)
    ctx.model = model = classifier(ctx, req.model)
    ctx.check_count(len(req.input))
    result = await ctx.run(wire.infinity.classify_call(req, model, ctx.request_id))
    return wire.infinity.classify_response(model, result, ctx.request_id)


async def hf_task(
    ctx: Context, parameters: object
) -> list[wire.hf.TokenEntity] | list[wire.hf.LabelScore] | list[list[wire.hf.LabelScore]]:
    """A Hugging Face task body on `POST /`: the task its `parameters` name, else (`{}`: what
    `huggingface_hub` sends when none is set) the one the model's extract kind serves."""
    task = wire.hf.task_of(parameters)
    if task == "zero_shot":
        return await zero_shot_classification(ctx)
    if task == "text_classification":
        return await text_classification(ctx)
    if task == "token_classification":
        return await token_classification(ctx)
    model = ctx.default_model("extract", kinds=TOKEN_CLASSIFIERS + CLASSIFIERS)
    if ctx.status(model).extract in CLASSIFIERS:
        return await text_classification(ctx, model)
    return await token_classification(ctx, model)


async def token_classification(ctx: Context, named: str | None = None) -> list[wire.hf.TokenEntity]:
    req = ctx.decode(wire.hf.TokenClassificationRequest)
    ctx.model = model = ctx.default_model("extract", named, kinds=TOKEN_CLASSIFIERS)
    result = await ctx.run(wire.hf.token_classification_call(req, model, ctx.request_id))
    return wire.hf.entities(req, result)


async def zero_shot_classification(ctx: Context) -> list[wire.hf.LabelScore]:
    """Every candidate label, best first, from an NLI, GLiClass or GLiNER2 model (`wire.hf`)."""
    req = ctx.decode(wire.hf.ZeroShotRequest)
    ctx.model = model = model_of_kinds(ctx, None, ZERO_SHOT, "a zero-shot classifier")
    kind = ctx.status(model).extract or ""  # a kind of ZERO_SHOT, as model_of_kinds checked
    result = await ctx.run(wire.hf.zero_shot_call(req, model, kind, ctx.request_id))
    return wire.hf.labels(result)


async def text_classification(ctx: Context, named: str | None = None) -> list[list[wire.hf.LabelScore]]:
    """`[[{"label", "score"}]]`: the Inference API's list per input, which `InferenceClient` unwraps."""
    req = ctx.decode(wire.hf.TextClassificationRequest)
    ctx.model = model = classifier(ctx, named)
    result = await ctx.run(wire.hf.text_classification_call(req, model, ctx.request_id))
    return [wire.hf.labels(result)]
