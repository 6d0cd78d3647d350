"""Hugging Face text-embeddings-inference (TEI) `/rerank`: its request and its bare-list response.

TEI's body names no model: the route picks one (`?model=`, `X-Shoal-Model`, else the server's
default scoring model). TEI's defaults hold: `truncate` false (a text longer than the model takes
is an error), scores through the model's activation unless `raw_scores`. Only right truncation is
served; `truncation_direction: "Left"` is refused.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from ..calls import ScoreCall, ScoreResult
from ..errors import InvalidRequest


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True):
    query: Annotated[str, msgspec.Meta(min_length=1)]
    texts: Annotated[list[str], msgspec.Meta(min_length=1)]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = False  # None: false, as TEI reads it
    # TEI's OpenAPI spells them "Left" / "Right"; its own default is written "right".
    truncation_direction: Literal["Right", "right", "Left", "left"] = "Right"


class Rank(msgspec.Struct, omit_defaults=True):
    index: int
    score: float
    text: str | None = None  # only with return_text


def score_call(req: RerankRequest, model: str, request_id: str | None = None) -> ScoreCall:
    if req.truncation_direction.lower() == "left":
        raise InvalidRequest(
            "truncation_direction \"Left\" is not supported: shoal truncates on the right only; "
            "send \"Right\" or omit it", details={"path": "$.truncation_direction"})
    return ScoreCall(model=model, query=req.query, documents=req.texts, raw_scores=req.raw_scores,
                     truncate=bool(req.truncate), request_id=request_id)


def ranks(req: RerankRequest, result: ScoreResult) -> list[Rank]:
    """Best first, as TEI sorts them."""
    return [Rank(index=item.index, score=item.score, text=req.texts[item.index] if req.return_text else None)
            for item in result.items]
