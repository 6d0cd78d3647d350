"""Cohere `/v1/rerank` and `/v2/rerank`, and Jina's rerank shape (also served on `/v1/rerank`).
Cohere's embed routes are `cohere_embed`'s; the `meta.api_version` both answer with is here.

Jina's request is a subset of Cohere v1's, so one request type reads both; the one `/v1/rerank`
response carries Cohere's fields (`id`, `results`, `meta`) and Jina's (`model`, `usage`, `results`)
so either client parses it. `return_documents` defaults to false (Cohere's default; Jina clients
that read `document` must send true). Documents are strings or objects of string fields: an object
is ranked by its `text`, or on v1 by `rank_fields` (each named field as a `name: value` line, in
the order given), and is echoed back whole when documents are returned.

Accepted and ignored: v1 `max_chunks_per_doc` (documents are truncated to the model's length, not
chunked; the native `/v1/score` has `window_overlap_tokens` for that), v2 `priority`, v2
`relevant_spans` unless enabled (refused: shoal does not compute spans).
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from ..calls import ScoreCall, ScoreResult
from ..errors import InvalidRequest

Document = str | dict[str, str]
DOCUMENTS_PER_SEARCH_UNIT = 100  # Cohere bills one search unit per query and up to 100 documents


class _RerankRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    query: Annotated[str, msgspec.Meta(min_length=1)]
    documents: Annotated[list[Document], msgspec.Meta(min_length=1)]
    top_n: Annotated[int, msgspec.Meta(ge=1)] | None = None
    return_documents: bool | None = None  # None: false
    max_tokens_per_doc: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # shoal's own: each relevance_score mapped into 0..1 by its model kind's bound, order kept
    # (Cohere's own models answer 0..1; a cosine, a SPLADE dot product or a logit do not).
    unit_scores: bool = False


class RerankRequest(_RerankRequest, kw_only=True):
    """`/v1/rerank`: Cohere v1 or Jina. No `model`: the server's default scoring model."""

    model: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    rank_fields: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    max_chunks_per_doc: Annotated[int, msgspec.Meta(ge=1)] | None = None  # accepted, ignored


class RelevantSpans(msgspec.Struct, forbid_unknown_fields=True):
    mode: str
    threshold: float | None = None
    max_spans: int | None = None


class RerankV2Request(_RerankRequest, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    relevant_spans: RelevantSpans | None = None
    priority: int | None = None  # accepted, ignored

    def check(self) -> None:
        if self.relevant_spans is not None and self.relevant_spans.mode != "disabled":
            raise InvalidRequest(
                f"relevant_spans mode {self.relevant_spans.mode!r} is not supported: shoal does not compute "
                'relevant spans; omit `relevant_spans` or set its mode to "disabled"',
                details={"path": "$.relevant_spans.mode"},
            )


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: dict[str, str] | None = None  # only with return_documents


class ApiVersion(msgspec.Struct):
    """`meta.api_version` of every Cohere response, rerank and embed: "1" or "2", the route's version."""

    version: str


class BilledUnits(msgspec.Struct):
    search_units: int


class Meta(msgspec.Struct):
    api_version: ApiVersion
    billed_units: BilledUnits


class JinaUsage(msgspec.Struct):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(msgspec.Struct):
    """`/v1/rerank`: Cohere v1's fields and Jina's in one body."""

    id: str
    model: str
    results: list[RerankResult]  # best first
    meta: Meta
    usage: JinaUsage


class RerankV2Response(msgspec.Struct):
    id: str
    results: list[RerankResult]
    meta: Meta


def texts_of(documents: list[Document], rank_fields: list[str] | None = None) -> list[str]:
    """The text each document is ranked by."""
    texts = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            texts.append(doc)
            continue
        fields = rank_fields or ["text"]
        missing = [name for name in fields if name not in doc]
        if missing:
            hint = "list fields it has in `rank_fields`" if rank_fields else "give it a `text` field or send a string"
            raise InvalidRequest(
                f"documents[{i}] has no field {missing[0]!r} to rank by: {hint}",
                details={"path": f"$.documents[{i}]", "field": missing[0]},
            )
        texts.append(doc["text"] if rank_fields is None else "\n".join(f"{name}: {doc[name]}" for name in fields))
    return texts


def score_call(req: _RerankRequest, model: str, texts: list[str], request_id: str | None = None) -> ScoreCall:
    return ScoreCall(
        model=model,
        query=req.query,
        documents=texts,
        top_k=req.top_n,
        max_tokens_per_doc=req.max_tokens_per_doc,
        unit_scores=req.unit_scores,
        request_id=request_id,
    )


def _results(req: _RerankRequest, result: ScoreResult) -> list[RerankResult]:
    def document(index: int) -> dict[str, str] | None:
        if not req.return_documents:
            return None
        doc = req.documents[index]
        return {"text": doc} if isinstance(doc, str) else doc

    return [
        RerankResult(index=item.index, relevance_score=item.score, document=document(item.index))
        for item in result.items
    ]


def _meta(version: str, num_documents: int) -> Meta:
    units = max(1, math.ceil(num_documents / DOCUMENTS_PER_SEARCH_UNIT))
    return Meta(api_version=ApiVersion(version=version), billed_units=BilledUnits(search_units=units))


def rerank_response(req: RerankRequest, model: str, result: ScoreResult, request_id: str) -> RerankResponse:
    return RerankResponse(
        id=request_id,
        model=model,
        results=_results(req, result),
        meta=_meta("1", len(req.documents)),
        usage=JinaUsage(total_tokens=result.num_tokens, prompt_tokens=result.num_tokens),
    )


def rerank_v2_response(req: RerankV2Request, result: ScoreResult, request_id: str) -> RerankV2Response:
    return RerankV2Response(id=request_id, results=_results(req, result), meta=_meta("2", len(req.documents)))
