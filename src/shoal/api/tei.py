"""Handlers of the TEI-compatible routes (text-embeddings-inference): `/embed`, `/embed_sparse`,
`/similarity`, `/tokenize`, `/decode`, `/predict`, `/` (by its body: a similarity, a rerank, a
predict or an embedding request, or a Hugging Face task body: `peers`), `/info`. `/rerank` lives
with the other rerank routes (`routes.tei_rerank`). Bodies name no model: `?model=`, the
`X-Shoal-Model` header, `--default-model`, else the one preloaded model that serves the route
(encodes; for `/predict`, classifies).
"""

from __future__ import annotations

import numpy as np

from .. import __version__, wire
from ..config import Settings
from ..errors import InvalidRequest
from ..service import ModelStatus, Token
from . import peers, routes
from .routes import Context


async def embed(ctx: Context) -> list[np.ndarray]:
    req = ctx.decode(wire.tei.EmbedRequest)
    ctx.model = model = ctx.default_model("encode", output="dense")
    call = wire.tei.embed_call(req, model, ctx.request_id, auto_truncate=ctx.auto_truncate)
    ctx.check_count(len(call.items))
    result = await ctx.run(call)
    ctx.result_bytes = sum(v.nbytes for v in result.vectors) * 4  # JSON floats
    return result.vectors


async def embed_all(ctx: Context) -> list[np.ndarray]:
    req = ctx.decode(wire.tei.EmbedSparseRequest)
    ctx.model = model = ctx.default_model("encode")
    call = wire.tei.unpooled_call(req, model, "token_states", ctx.request_id, auto_truncate=ctx.auto_truncate)
    ctx.check_count(len(call.items))
    result = await ctx.run(call)
    states = [item.token_states for item in result.items if item.token_states is not None]
    if len(states) != len(result.items):
        raise ValueError("an /embed_all result without token states")
    ctx.result_bytes = sum(s.nbytes for s in states) * 4  # JSON floats
    return states


async def tokenize(ctx: Context) -> list[list[Token]]:
    req = ctx.decode(wire.tei.TokenizeRequest)
    ctx.model = model = ctx.default_model("encode")
    texts = wire.tei.texts_of(req.inputs)
    ctx.check_count(len(texts))
    ctx.status(model)
    return await ctx.service.tokenize(
        model, texts, req.add_special_tokens, req.prompt_name, may_download=ctx.principal.may_download
    )


async def decode(ctx: Context) -> list[str]:
    req = ctx.decode(wire.tei.DecodeRequest)
    ctx.model = model = ctx.default_model("encode")
    sequences = req.sequences()
    ctx.check_count(len(sequences))
    ctx.status(model)
    return await ctx.service.detokenize(
        model, sequences, req.skip_special_tokens, may_download=ctx.principal.may_download
    )


async def embed_sparse(ctx: Context) -> list[list[wire.tei.SparseValue]]:
    req = ctx.decode(wire.tei.EmbedSparseRequest)
    ctx.model = model = ctx.default_model("encode", output="sparse")
    call = wire.tei.unpooled_call(req, model, "sparse", ctx.request_id, auto_truncate=ctx.auto_truncate)
    ctx.check_count(len(call.items))
    return wire.tei.sparse_values(await ctx.run(call))


async def similarity(ctx: Context) -> list[float]:
    req = ctx.decode(wire.tei.SimilarityRequest)
    ctx.model = model = ctx.default_model("encode", output="dense")
    call = wire.tei.similarity_call(req, model, ctx.request_id, auto_truncate=ctx.auto_truncate)
    ctx.check_count(len(req.inputs.sentences))  # the source sentence rides along, as on TEI
    return wire.tei.similarities(await ctx.run(call))


async def predict(ctx: Context) -> list[wire.tei.Prediction] | list[list[wire.tei.Prediction]]:
    """TEI's `/predict`: one sequence's labels (a text or a pair), or a batch's, each best first.
    A batch may mix texts and pairs: one call of each, run side by side."""
    req = ctx.decode(wire.tei.PredictRequest)
    ctx.model = model = peers.classifier(ctx)
    sequences, batch = req.sequences()
    ctx.check_count(len(sequences))
    parts = wire.tei.predict_calls(req, sequences, model, ctx.request_id, auto_truncate=ctx.auto_truncate)
    first_cut = len(ctx.truncated)
    results = await peers.run_together([ctx.run(call) for _, call in parts])
    labels, cut = wire.tei.predictions(len(sequences), [held for held, _ in parts], results)
    ctx.truncated[first_cut:] = cut  # by the sequences' indices, not each call's own
    return labels if batch else labels[0]


async def root(
    ctx: Context,
) -> (
    list[np.ndarray]
    | list[float]
    | list[wire.tei.Rank]
    | list[wire.tei.Prediction]
    | list[list[wire.tei.Prediction]]
    | list[wire.hf.TokenEntity]
    | list[wire.hf.LabelScore]
    | list[list[wire.hf.LabelScore]]
):
    """`POST /`: TEI serves its model's one verb here; shoal reads the body to tell which. A body
    with `parameters` (and not `inputs` an object) is a Hugging Face task's (`peers.hf_task`); one
    that is `/predict`'s, or meant for a classifier, is classified; else it is embedded."""
    fields = ctx.fields()
    if isinstance(fields.get("inputs"), dict):
        return await similarity(ctx)
    if "query" in fields and "texts" in fields:
        return await routes.tei_rerank(ctx)
    if "parameters" in fields:
        return await peers.hf_task(ctx, fields["parameters"])
    if _predicts(ctx, fields):
        return await predict(ctx)
    return await embed(ctx)


def _predicts(ctx: Context, fields: dict[str, object]) -> bool:
    """Whether a TEI body on `/` is `/predict`'s: it has `raw_scores` or a batch of lists (which
    `/embed`'s body has not), or the model it names is a classifier, or it names none and the
    server has a classifier to default to but no embedder (several embedders: still embed's 400)."""
    inputs = fields.get("inputs")
    if "raw_scores" in fields or (isinstance(inputs, list) and any(isinstance(i, list) for i in inputs)):
        return True
    named = ctx.requested_model()
    if named:
        return ctx.status(named).extract in peers.CLASSIFIERS
    return _classifies_by_default(ctx)


def _classifies_by_default(ctx: Context) -> bool:
    """Whether the server has a classifier to default to but no embedder: a TEI serving a classifier."""
    return not ctx.default_candidates("encode", output="dense") and bool(
        ctx.default_candidates("extract", kinds=peers.CLASSIFIERS)
    )


async def info(ctx: Context) -> wire.JSONObject:
    """`?task=` picks the default model of that task (encode unless the server classifies by default)."""
    settings: Settings = ctx.request.app.state.settings
    task = ctx.request.query_params.get("task")
    if task not in (None, "encode", "score", "extract"):
        raise InvalidRequest(f"task {task!r} is not one of encode, score, extract", details={"option": "task"})
    if task is None and not ctx.requested_model() and _classifies_by_default(ctx):
        ctx.model = model = peers.classifier(ctx)
    else:
        ctx.model = model = ctx.default_model(task or "encode")
    return _info(
        ctx.status(model),
        max_batch_tokens=settings.engine.max_batch_tokens,
        max_client_batch_size=settings.server.max_items_per_request,
        tokenization_workers=settings.engine.tokenizer_threads,
        max_concurrent_requests=settings.server.max_connections,
        version=__version__,
    )


def _info(
    status: ModelStatus,
    *,
    max_batch_tokens: int,
    max_client_batch_size: int,
    tokenization_workers: int,
    max_concurrent_requests: int,
    version: str,
) -> wire.JSONObject:
    """TEI's `/info` for the model a request would use: an embedder's pooling, a reranker's one
    label, or a classifier's labels (`ModelStatus.labels`: config.json's id2label)."""
    if "encode" in status.tasks:
        model_type: wire.JSONObject = {
            "embedding": {"pooling": "splade" if status.outputs == ("sparse",) else status.pooling or "none"}
        }
    elif "score" in status.tasks:
        model_type = {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    else:  # an extraction model; a text classifier's labels are known while it is loaded
        model_type = {
            "classifier": {
                "id2label": {str(i): label for i, label in enumerate(status.labels)},
                "label2id": {label: i for i, label in enumerate(status.labels)},
            }
        }
    return {
        "model_id": status.id,
        "model_sha": None,
        "model_dtype": "float32",
        "served_model_name": status.id,
        "model_type": model_type,
        "max_concurrent_requests": max_concurrent_requests,
        "max_input_length": status.max_length,
        "max_batch_tokens": max_batch_tokens,
        "max_batch_requests": None,
        "max_client_batch_size": max_client_batch_size,
        "auto_truncate": False,
        "tokenization_workers": tokenization_workers,
        "version": version,
        "sha": None,
        "docker_label": None,
    }
