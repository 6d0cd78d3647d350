"""Route handlers: thin module-level functions from a decoded wire request to a service call.

Each handler takes the request context and returns the response object; `endpoint` in
`shoal.api.app` reads the body, picks the formats, maps errors and records metrics once for all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, overload

import msgspec
from starlette.requests import Request

from .. import wire
from ..calls import (
    AnyCall,
    AnyResult,
    EncodeCall,
    EncodeResult,
    ExtractCall,
    ExtractResult,
    GenerateCall,
    GenerateResult,
    ScoreCall,
    ScoreResult,
)
from ..calls import EncodedItem as CallEncodedItem
from ..errors import InputTooLong, InvalidRequest, UnknownModel
from ..service import ADMIN_ACTIONS, ModelStatus, Service
from .auth import ANONYMOUS, Principal

T = TypeVar("T")


@dataclass
class Context:
    request: Request
    service: Service
    body: bytes
    fmt_in: wire.Format
    max_items: int
    request_id: str
    model: str | None = None  # set once known, for metric labels and the X-Shoal-Model answer header
    adapter: str | None = None  # the call's adapter, for the X-Shoal-Adapter answer header
    auto_truncate: bool = False  # TEI's routes: cut over-long texts when the body does not say (--auto-truncate)
    # Indices of the items cut to fit, over every call the route made, for the X-Shoal-Truncated header.
    truncated: list[int] = field(default_factory=list)
    result_bytes: int = 0  # array bytes in the response, to encode large ones off the event loop
    preload: tuple[str, ...] = ()  # the server's preloaded models, in order
    principal: Principal = ANONYMOUS  # who is calling (api/auth.py)
    default: str | None = None  # the server's `--default-model`

    def decode(self, typ: type[T]) -> T:
        """The body as `typ` (InvalidRequest, naming the problem, if it is not one)."""
        return wire.decode(self.body, self.fmt_in, typ)

    def fields(self) -> dict[str, object]:
        """The body's top-level fields, untyped, for a route that picks its request type by them
        ({} when the body is not an object, or is malformed: the typed decode then says why)."""
        try:
            decode = msgspec.json.decode if self.fmt_in is wire.Format.JSON else msgspec.msgpack.decode
            shape = decode(self.body)
        except (msgspec.DecodeError, RecursionError):
            return {}
        return shape if isinstance(shape, dict) else {}

    def status(self, model_id: str) -> ModelStatus:
        """The model's status if this caller may use it; an alias answers, and is checked, as the
        model it names. Else UnknownModel, the same whether the model is not served here or off
        the caller's allow-list, suggesting only ids the caller may use: a limited token learns
        nothing of the other models."""
        if self.principal.models is None:
            return self.service.model(model_id)
        try:
            status: ModelStatus | None = self.service.model(model_id)
        except UnknownModel:
            status = None
        if status is not None and self.principal.may_use(status.id):
            return status
        raise UnknownModel.named(model_id, [s.id for s in self.service.models() if self.principal.may_use(s.id)])

    @overload
    async def run(self, call: EncodeCall) -> EncodeResult: ...
    @overload
    async def run(self, call: ScoreCall) -> ScoreResult: ...
    @overload
    async def run(self, call: ExtractCall) -> ExtractResult: ...
    @overload
    async def run(self, call: GenerateCall) -> GenerateResult: ...

    async def run(self, call: AnyCall) -> AnyResult:
        """The service's answer, if this caller may use the call's model (the result of the call's
        verb: the service raises the error a call ends in). Whether serving it may download the
        model is the caller's right, whatever the call said."""
        self.status(call.model)
        self.adapter = call.adapter
        result = await self.service.run(msgspec.structs.replace(call, may_download=self.principal.may_download))
        self.truncated.extend(_truncated(result))
        return result

    def scoring_model(self, named: str | None = None) -> str:
        """The model a score route uses: the body's, else `?model=`, else the `X-Shoal-Model`
        header, else the server's default model if it scores, else the first preloaded reranker,
        else the first preloaded model that scores."""
        return self.default_model("score", named)

    def default_model(
        self, task: str, named: str | None = None, output: str | None = None, kinds: tuple[str, ...] = ()
    ) -> str:
        """The model a route whose body may name none uses (TEI's, Cohere v1 rerank): the body's,
        `?model=`, the `X-Shoal-Model` header, else the one of `default_candidates`.
        Several candidates (preloaded models that could serve it, and no default): InvalidRequest
        naming them, rather than an answer from a model the client may not have meant."""
        model = named or self.requested_model()
        if model:
            return model
        candidates = self.default_candidates(task, output, kinds)
        if len(candidates) == 1:
            return candidates[0]
        usable = {status.id for status in self.service.models() if self.principal.may_use(status.id)}
        default = (
            self.service.model(self.default).id if self.default and self.service.has_model(self.default) else None
        )  # an alias names its model
        verb = {"score": "scores", "encode": "encodes", "extract": "extracts"}[task]
        verb += f" {output} vectors" if output else ""
        verb += f" ({' or '.join(kinds)})" if kinds else ""
        if candidates:
            raise InvalidRequest(
                f"this request names no model, and {len(candidates)} preloaded models could serve it "
                f"({', '.join(candidates)}) with no default set: name one with `?model=ID` or the "
                "`X-Shoal-Model: ID` header, or start the server with `--default-model ID`",
                details={"candidates": candidates, "default_model": self.default if default in usable else None},
            )
        raise InvalidRequest(
            f"this request names no model and no default or preloaded model {verb}: name one with `?model=ID` "
            "or the `X-Shoal-Model: ID` header, or start the server with `--default-model` or `--preload` "
            "(`GET /v1/models` lists each model's tasks)",
            details={
                "preloaded": [m for m in self.preload if m in usable],
                "default_model": self.default if default in usable else None,
            },
        )

    def default_candidates(self, task: str, output: str | None = None, kinds: tuple[str, ...] = ()) -> list[str]:
        """The models a request that names none may mean: the server's `--default-model` if it
        serves `task` (and has `output`; for extract, is of one of `kinds` when given), else the
        preloaded models that do (for score: the rerankers, else the embedders); of the last two,
        only models this caller may use (and is told of)."""
        statuses = {status.id: status for status in self.service.models() if self.principal.may_use(status.id)}
        default = self.service.model(self.default).id if self.default and self.service.has_model(self.default) else None
        tasks = {m: s.tasks for m, s in statuses.items()}

        def serves(m: str) -> bool:
            return (
                task in tasks.get(m, ())
                and (output is None or output in statuses[m].outputs)
                and (not kinds or statuses[m].extract in kinds)
            )

        if default and serves(default):
            return [default]
        preloaded = list(dict.fromkeys(m for m in self.preload if m and serves(m)))
        if task == "score":  # among preloaded models, a reranker before an embedder that scores by cosine
            preloaded = [m for m in preloaded if "encode" not in tasks[m]] or preloaded
        return preloaded

    def requested_model(self) -> str | None:
        """The model the request names outside its body: `?model=`, else the `X-Shoal-Model` header."""
        return self.request.query_params.get("model") or self.request.headers.get("x-shoal-model") or None

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
    result: EncodeResult = await ctx.run(wire.native.encode_call(req, ctx.request_id))
    ctx.result_bytes = _array_bytes(result)
    items = [_item(item.id, out) for item, out in zip(req.items, result.items)]
    return wire.EncodeResponse(
        model=req.model,
        items=items,
        usage=wire.usage_of(result),
        timings=wire.native.timings_of(result),
    )


async def extract(ctx: Context) -> wire.ExtractResponse:
    req: wire.ExtractRequest = ctx.decode(wire.ExtractRequest)
    ctx.model = req.model
    ctx.check_count(len(req.items))
    result: ExtractResult = await ctx.run(wire.native.extract_call(req, ctx.request_id))
    return wire.native.extract_response(req, result)


async def score(ctx: Context) -> wire.ScoreResponse:
    req: wire.ScoreRequest = ctx.decode(wire.ScoreRequest)
    ctx.model = req.model
    ctx.check_count(len(req.items))
    result: ScoreResult = await ctx.run(wire.native.score_call(req, ctx.request_id))
    return wire.native.score_response(req, result)


async def rerank(ctx: Context) -> wire.cohere.RerankResponse:
    """Cohere v1 and Jina: one body both clients parse."""
    req: wire.cohere.RerankRequest = ctx.decode(wire.cohere.RerankRequest)
    ctx.model = model = ctx.scoring_model(req.model)
    ctx.check_count(len(req.documents))
    texts = wire.cohere.texts_of(req.documents, req.rank_fields)
    result: ScoreResult = await ctx.run(wire.cohere.score_call(req, model, texts, ctx.request_id))
    return wire.cohere.rerank_response(req, model, result, ctx.request_id)


async def rerank_v2(ctx: Context) -> wire.cohere.RerankV2Response:
    req: wire.cohere.RerankV2Request = ctx.decode(wire.cohere.RerankV2Request)
    ctx.model = req.model
    req.check()
    ctx.check_count(len(req.documents))
    texts = wire.cohere.texts_of(req.documents)
    result: ScoreResult = await ctx.run(wire.cohere.score_call(req, req.model, texts, ctx.request_id))
    return wire.cohere.rerank_v2_response(req, result, ctx.request_id)


async def tei_rerank(ctx: Context) -> list[wire.tei.Rank]:
    """TEI's body names no model: `?model=`, `X-Shoal-Model`, else the default scoring model."""
    req: wire.tei.RerankRequest = ctx.decode(wire.tei.RerankRequest)
    ctx.model = model = ctx.scoring_model()
    ctx.check_count(len(req.texts))
    result: ScoreResult = await ctx.run(
        wire.tei.score_call(req, model, ctx.request_id, auto_truncate=ctx.auto_truncate)
    )
    return wire.tei.ranks(req, result)


async def embeddings(ctx: Context) -> wire.EmbeddingsResponse:
    """OpenAI-compatible: the official client sends `encoding_format: base64` by default."""
    req: wire.EmbeddingsRequest = ctx.decode(wire.EmbeddingsRequest)
    ctx.model = req.model
    texts = req.texts()
    ctx.check_count(len(texts))
    result = await ctx.run(
        EncodeCall(
            model=req.model,
            items=texts,
            dimensions=req.dimensions,
            outputs=("dense",),
            request_id=ctx.request_id,
            is_query=req.is_query,
            prompt_name=req.prompt_name,
            truncate=req.truncate is not False,
        )
    )
    ctx.result_bytes = _array_bytes(result) * (1 if req.format == "base64" else 4)
    data = [wire.openai_embedding(i, v, req.format) for i, v in enumerate(result.vectors)]
    usage = wire.EmbeddingsUsage(prompt_tokens=result.num_tokens, total_tokens=result.num_tokens)
    return wire.EmbeddingsResponse(data=data, model=req.model, usage=usage)


async def models(ctx: Context) -> wire.ModelList:
    """OpenAI's list shape; only the models this caller may use; cards that could not be read,
    for a caller of every model (a card's file and error name models a limited token may not see)."""
    data = [_model_entry(status) for status in ctx.service.models() if ctx.principal.may_use(status.id)]
    listed: wire.ModelList = {"object": "list", "data": data}
    problems: list[wire.models.CardProblemEntry] = [{"file": p.file, "error": p.error} for p in ctx.service.problems()]
    if problems and ctx.principal.models is None:
        listed["errors"] = problems
    return listed


async def model(ctx: Context) -> wire.ModelEntry:
    """`GET /v1/models/{id}` (what the OpenAI client's `models.retrieve` calls)."""
    model_id: str = ctx.request.path_params["model_path"]
    ctx.model = model_id
    return _model_entry(ctx.status(model_id))


async def model_admin(ctx: Context) -> wire.ModelEntry:
    """`POST /v1/models/{id}/load|unload|pin|unpin` (admin scope): the action, then the status."""
    path: str = ctx.request.path_params["model_path"]
    model_id, _, action = path.rpartition("/")
    if action not in ADMIN_ACTIONS or not model_id:
        raise UnknownModel(
            f"POST /v1/models/{{id}}/ACTION: ACTION is one of {', '.join(ADMIN_ACTIONS)}, not {action!r}",
            details={"actions": list(ADMIN_ACTIONS)},
        )
    ctx.model = model_id
    ctx.status(model_id)  # an admin token's allow-list binds it too
    return _model_entry(await ctx.service.admin(model_id, action))


def _model_entry(status: ModelStatus) -> wire.ModelEntry:
    entry: wire.ModelEntry = {
        "id": status.id,
        "object": "model",
        "created": 0,
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
        "state": status.state,
        "bytes": status.bytes,
        "pinned": status.pinned,
        "device": status.device,
        "adapters": [{"id": name, "loaded": name in status.adapters_loaded} for name in status.adapters],
        "aliases": list(status.aliases),
        "description": status.description,
    }
    if status.extract:
        entry["extract"] = status.extract
    if status.error:
        entry["error"] = status.error
    if status.weights:
        entry["weights"] = status.weights
    if status.precision:
        entry["precision"] = status.precision
    return entry


def _array_bytes(result: EncodeResult) -> int:
    if not result.items:
        return 0
    first = result.items[0]
    per_item = sum(a.nbytes for a in (first.dense, first.multivector) if a is not None)
    if first.sparse is not None:
        per_item += first.sparse.indices.nbytes * 2
    return per_item * len(result.items)


def _truncated(result: AnyResult) -> list[int]:
    """The indices of the result's items that were cut to fit the model."""
    if isinstance(result, EncodeResult):
        return [i for i, item in enumerate(result.items) if item.truncated]
    if isinstance(result, ScoreResult):
        return sorted(item.index for item in result.items if item.truncated)
    if isinstance(result, ExtractResult):
        return [i for i, item in enumerate(result.items) if item.truncated]
    return []


def _item(item_id: wire.ItemId, out: CallEncodedItem) -> wire.EncodedItem:
    sparse = None
    if out.sparse is not None:
        sparse = wire.SparseOut(indices=out.sparse.indices, values=out.sparse.values, tokens=out.sparse.tokens)
    return wire.EncodedItem(
        id=item_id, dense=out.dense, sparse=sparse, multivector=out.multivector, truncated=out.truncated
    )


async def embed_v2(ctx: Context) -> wire.cohere_embed.EmbedByTypeResponse:
    """Cohere v2: every requested embedding type, derived from one float32 forward."""
    req: wire.cohere_embed.EmbedV2Request = ctx.decode(wire.cohere_embed.EmbedV2Request)
    ctx.model = req.model
    inputs = req.inputs_of()
    ctx.check_count(len(inputs))
    call = wire.cohere_embed.encode_call(req, req.model, inputs, ctx.request_id)
    if req.max_tokens is not None:
        req.check_max_tokens(ctx.status(req.model).max_length)
    result = await _cohere_encode(ctx, call)
    ctx.result_bytes = _array_bytes(result) * 4 * len(req.types())
    return wire.cohere_embed.embed_by_type_response(
        req, "2", wire.cohere_embed.texts_in(inputs), result, ctx.request_id
    )


async def cohere_embed_v1(
    ctx: Context,
) -> wire.cohere_embed.EmbedByTypeResponse | wire.cohere_embed.EmbedFloatsResponse:
    """Cohere v1: floats by default, by type when `embedding_types` is sent."""
    req: wire.cohere_embed.EmbedRequest = ctx.decode(wire.cohere_embed.EmbedRequest)
    ctx.model = model = req.model_of()
    inputs = req.inputs_of()
    ctx.check_count(len(inputs))
    result = await _cohere_encode(ctx, wire.cohere_embed.encode_call(req, model, inputs, ctx.request_id))
    ctx.result_bytes = _array_bytes(result) * 4 * len(req.types())
    return wire.cohere_embed.embed_response(req, "1", wire.cohere_embed.texts_in(inputs), result, ctx.request_id)


async def _cohere_encode(ctx: Context, call: EncodeCall) -> EncodeResult:
    try:
        return await ctx.run(call)
    except InputTooLong as exc:  # the engine's words name its options; say it in Cohere's
        raise wire.cohere_embed.too_long(exc) from None
