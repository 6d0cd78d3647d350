"""vLLM's score API on `/score`: `{"model"?, "text_1": str | [str], "text_2": str | [str],
"use_activation"?}` → `{"id", "object": "list", "created", "model", "data": [{"index", "object":
"score", "score"}], "usage"}`, as vLLM's `ScoreRequest` and `ScoreResponse` define them.

One `text_1` is scored against every `text_2`; as many `text_1` as `text_2` are scored pairwise
(`text_1[i]` with `text_2[i]`); other counts are refused. `data` is in `text_2`'s order, not ranked.
vLLM also serves this on `/v1/score`, which is shoal's native score route here.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from ..calls import ScoreCall, ScoreResult
from ..errors import InvalidRequest

Texts = str | Annotated[list[str], msgspec.Meta(min_length=1)]


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    text_1: Texts
    text_2: Texts
    model: Annotated[str, msgspec.Meta(min_length=1)] | None = None  # None: the default scoring model
    use_activation: bool | None = None  # false: the logit (default: through the model's activation)


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(msgspec.Struct):
    id: str
    model: str
    data: list[ScoreData]  # in text_2's order
    usage: ScoreUsage
    created: int  # unix seconds
    object: str = "list"


def _texts(value: Texts) -> list[str]:
    return [value] if isinstance(value, str) else value


def score_calls(req: ScoreRequest, model: str, request_id: str | None = None) -> list[ScoreCall]:
    """One call for one `text_1` against every `text_2`; one call per pair when scored pairwise."""
    firsts, seconds = _texts(req.text_1), _texts(req.text_2)
    raw = req.use_activation is False

    def call(query: str, documents: list[str]) -> ScoreCall:
        return ScoreCall(model=model, query=query, documents=documents, raw_scores=raw, request_id=request_id)

    if len(firsts) == 1:
        return [call(firsts[0], seconds)]
    if len(firsts) == len(seconds):
        return [call(first, [second]) for first, second in zip(firsts, seconds)]
    raise InvalidRequest(
        f"text_1 has {len(firsts)} texts and text_2 has {len(seconds)}: send one text_1 (scored against "
        "every text_2) or as many as text_2 (scored pairwise)",
        details={"path": "$.text_1", "text_1": len(firsts), "text_2": len(seconds)},
    )


def score_response(model: str, results: list[ScoreResult], request_id: str) -> ScoreResponse:
    """`results` are `score_calls`' answers, in its order."""
    if len(results) == 1:
        data = sorted((ScoreData(index=item.index, score=item.score) for item in results[0].items), key=_index)
    else:  # pairwise: call i scored pair i
        data = [ScoreData(index=i, score=result.items[0].score) for i, result in enumerate(results)]
    tokens = sum(result.num_tokens for result in results)
    usage = ScoreUsage(prompt_tokens=tokens, total_tokens=tokens)
    return ScoreResponse(id=request_id, model=model, data=data, usage=usage, created=int(time.time()))


def _index(data: ScoreData) -> int:
    return data.index
