"""Infinity's (and vLLM's) rerank body on `/rerank`: `{"model"?, "query", "documents": [str], "top_n"?,
"return_documents"?, "raw_scores"?}`, answered in Infinity's shape; and Infinity's `/classify`.

The route also serves TEI's rerank (`texts`); the body's fields pick which (`api.routes.tei_rerank`).
Infinity and vLLM send the same request here and answer it differently: Infinity's `document` is the
text, vLLM's (like Cohere's and Jina's) is `{"text"}`. This answer is Infinity's; `/v1/rerank` and
`/v2/rerank` answer document objects, for vLLM's clients. `top_n` 0 means all, as vLLM reads it.
Texts too long for the model are cut (as both servers do).

`/classify` (Infinity's ClassifyInput and ClassifyResult): `{"model"?, "input": [str], "raw_scores"?}`
→ `{"object": "classify", "data": [[{"score", "label"}]], "model", "usage", "id", "created"}`, each
text's labels all of them, best first (Infinity runs transformers' text-classification pipeline
with `top_k=None`). Infinity accepts `raw_scores` and ignores it; here it answers the logits.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from ..calls import ExtractCall, ExtractResult, ScoreCall, ScoreResult


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True):
    query: Annotated[str, msgspec.Meta(min_length=1)]
    documents: Annotated[list[str], msgspec.Meta(min_length=1)]
    model: Annotated[str, msgspec.Meta(min_length=1)] | None = None  # None: the default scoring model
    top_n: Annotated[int, msgspec.Meta(ge=0)] | None = None  # None or 0: every document, ranked
    return_documents: bool | None = False
    raw_scores: bool = False


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: str | None = None  # only with return_documents


class InfinityUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]  # best first
    usage: InfinityUsage
    created: int  # unix seconds
    object: str = "rerank"


def score_call(req: RerankRequest, model: str, request_id: str | None = None) -> ScoreCall:
    return ScoreCall(
        model=model,
        query=req.query,
        documents=req.documents,
        top_k=req.top_n or None,
        raw_scores=req.raw_scores,
        request_id=request_id,
    )


def rerank_response(req: RerankRequest, model: str, result: ScoreResult, request_id: str) -> RerankResponse:
    results = [
        RerankResult(
            index=item.index,
            relevance_score=item.score,
            document=req.documents[item.index] if req.return_documents else None,
        )
        for item in result.items
    ]
    usage = InfinityUsage(prompt_tokens=result.num_tokens, total_tokens=result.num_tokens)
    return RerankResponse(id=request_id, model=model, results=results, usage=usage, created=int(time.time()))


# --- /classify ------------------------------------------------------------------------------------


class ClassifyRequest(msgspec.Struct, forbid_unknown_fields=True):
    input: Annotated[list[str], msgspec.Meta(min_length=1)]
    model: Annotated[str, msgspec.Meta(min_length=1)] | None = None  # None: the default classifier
    raw_scores: bool = False


class ClassifyLabel(msgspec.Struct):
    score: float
    label: str


class ClassifyResponse(msgspec.Struct):
    id: str
    model: str
    data: list[list[ClassifyLabel]]  # per text, in request order; its labels best first
    usage: InfinityUsage
    created: int  # unix seconds
    object: str = "classify"


def classify_call(req: ClassifyRequest, model: str, request_id: str | None = None) -> ExtractCall:
    return ExtractCall(model=model, items=req.input, raw_scores=req.raw_scores, truncate=True, request_id=request_id)


def classify_response(model: str, result: ExtractResult, request_id: str) -> ClassifyResponse:
    data = [[ClassifyLabel(score=s.score, label=s.label) for s in item.labels or ()] for item in result.items]
    usage = InfinityUsage(prompt_tokens=result.num_tokens, total_tokens=result.num_tokens)
    return ClassifyResponse(id=request_id, model=model, data=data, usage=usage, created=int(time.time()))
