"""Hugging Face Inference API task bodies on `POST /`: `{"inputs": str, "parameters": {...}}`, as
`huggingface_hub`'s `InferenceClient` sends them, served by `extract`:

    token classification      parameters: aggregation_strategy, ignore_labels, stride
                              → [{"entity_group", "score", "word", "start", "end"}]
    zero-shot classification  parameters: candidate_labels, multi_label, hypothesis_template
                              → [{"label", "score"}], best first

`POST /` tells them apart by `parameters.candidate_labels` (`api.tei.root`). Entities come from a
token classifier's (or a GLiNER model's) grouped spans: `word` is the text's own slice
`inputs[start:end]`. Per-token answers (`aggregation_strategy: "none"`) are not served.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from ..calls import ExtractCall, ExtractResult
from ..errors import InvalidRequest

Aggregation = Literal["none", "simple", "first", "average", "max"]


class TokenClassificationParameters(msgspec.Struct, forbid_unknown_fields=True):
    aggregation_strategy: Aggregation | None = None  # None: the card's
    ignore_labels: list[str] | None = None
    stride: Annotated[int, msgspec.Meta(ge=0)] | None = None  # accepted, ignored: windows overlap as the card says
    labels: list[str] | None = None  # shoal's own: a GLiNER model's entity types; a tagger keeps only these


class TokenClassificationRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: str
    parameters: TokenClassificationParameters | None = None


class ZeroShotParameters(msgspec.Struct, forbid_unknown_fields=True):
    candidate_labels: Annotated[list[str], msgspec.Meta(min_length=1)]
    multi_label: bool | None = None  # None: false
    hypothesis_template: str | None = None  # None: the card's


class ZeroShotRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: str
    parameters: ZeroShotParameters


class TokenEntity(msgspec.Struct):
    entity_group: str
    score: float
    word: str
    start: int  # character offsets into `inputs` (code points)
    end: int


class LabelScore(msgspec.Struct):
    label: str
    score: float


def token_classification_call(
    req: TokenClassificationRequest, model: str, request_id: str | None = None
) -> ExtractCall:
    params = req.parameters or TokenClassificationParameters()
    if params.aggregation_strategy == "none":
        raise InvalidRequest(
            'aggregation_strategy "none" (one answer per token) is not served: shoal groups tokens into '
            "entities; send simple, first, average or max, or omit it",
            details={"path": "$.parameters.aggregation_strategy"},
        )
    return ExtractCall(
        model=model,
        items=[req.inputs],
        labels=params.labels or [],
        aggregation=params.aggregation_strategy,
        request_id=request_id,
    )


def entities(req: TokenClassificationRequest, result: ExtractResult) -> list[TokenEntity]:
    ignored = set((req.parameters and req.parameters.ignore_labels) or ())
    return [
        TokenEntity(entity_group=e.label, score=e.score, word=e.text, start=e.start, end=e.end)
        for e in result.items[0].entities or ()
        if e.label not in ignored
    ]


def zero_shot_call(req: ZeroShotRequest, model: str, request_id: str | None = None) -> ExtractCall:
    params = req.parameters
    return ExtractCall(
        model=model,
        items=[req.inputs],
        labels=params.candidate_labels,
        multi_label=params.multi_label,
        hypothesis_template=params.hypothesis_template,
        request_id=request_id,
    )


def labels(result: ExtractResult) -> list[LabelScore]:
    """Best first, as the extract result ranks them."""
    return [LabelScore(label=s.label, score=s.score) for s in result.items[0].labels or ()]
