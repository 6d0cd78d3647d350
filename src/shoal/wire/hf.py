"""Hugging Face Inference API task bodies on `POST /`: `{"inputs": str, "parameters": {...}}`, as
`huggingface_hub`'s `InferenceClient` sends them, served by `extract`:

    token classification      parameters: aggregation_strategy, ignore_labels, stride
                              → [{"entity_group", "score", "word", "start", "end"}]
    zero-shot classification  parameters: candidate_labels, multi_label, hypothesis_template
                              → [{"label", "score"}], best first, every candidate label
    text classification       parameters: top_k, function_to_apply
                              → [[{"label", "score"}]], best first (the list in a list the
                              Inference API answers and `InferenceClient` unwraps)

`POST /` tells them apart by their parameters (`task_of`), else by the model's extract kind
(`api.peers.hf_task`): `huggingface_hub` sends `"parameters": {}` when none is set. Entities come
from a token classifier's (or a GLiNER model's) grouped spans: `word` is the text's own slice
`inputs[start:end]`. Per-token answers (`aggregation_strategy: "none"`) are not served.

Zero-shot classification is served by three extract kinds, each call built by its entry in
`ZERO_SHOT_CALLS`: an NLI cross-encoder (zero_shot, as transformers' pipeline scores it), a
GLiClass model (gliclass: softmax across the labels, or each one's sigmoid when `multi_label`) and
a GLiNER2 model (gliner2: one classification task, `ZERO_SHOT_TASK`, over the labels; softmax
across them, or each one's sigmoid when `multi_label`). Each answers every candidate label, as the
Inference API does: GLiClass and GLiNER2 with no threshold (a text GLiNER2 reads in several
windows answers each label's best score over them). `hypothesis_template` is an NLI model's; the
other kinds refuse it.
"""

from __future__ import annotations

from collections.abc import Callable
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


class TextClassificationParameters(msgspec.Struct, forbid_unknown_fields=True):
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None  # None: the model config's
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None  # None: every label


class TextClassificationRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: str
    parameters: TextClassificationParameters | None = None


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


def zero_shot_call(req: ZeroShotRequest, model: str, kind: str, request_id: str | None = None) -> ExtractCall:
    """The call that asks a model of extract `kind` (one of `ZERO_SHOT_CALLS`) for a score per
    candidate label."""
    return ZERO_SHOT_CALLS[kind](req, model, request_id)


def _nli_call(req: ZeroShotRequest, model: str, request_id: str | None) -> ExtractCall:
    params = req.parameters
    return ExtractCall(
        model=model,
        items=[req.inputs],
        labels=params.candidate_labels,
        multi_label=params.multi_label,
        hypothesis_template=params.hypothesis_template,
        request_id=request_id,
    )


def _gliclass_call(req: ZeroShotRequest, model: str, request_id: str | None) -> ExtractCall:
    params = req.parameters
    return ExtractCall(
        model=model,
        items=[req.inputs],
        labels=params.candidate_labels,
        multi_label=bool(params.multi_label),  # gliclass's own default is multi-label; the API's is not
        threshold=0.0,  # every label, as the API answers (the card's threshold would drop some)
        hypothesis_template=params.hypothesis_template,  # refused by the kind, naming those that take it
        request_id=request_id,
    )


# The GLiNER2 classification task's name: it is part of the model's prompt, and the API names none.
ZERO_SHOT_TASK = "category"


def _gliner2_call(req: ZeroShotRequest, model: str, request_id: str | None) -> ExtractCall:
    params = req.parameters
    # Every label with its score: a multi-label task at threshold 0, its scores the softmax across
    # the labels (single-label) or each one's sigmoid.
    task = {
        "task": ZERO_SHOT_TASK,
        "labels": params.candidate_labels,
        "multi_label": True,
        "cls_threshold": 0.0,
        "class_act": "sigmoid" if params.multi_label else "softmax",
    }
    return ExtractCall(
        model=model,
        items=[req.inputs],
        schema={"classifications": [task]},
        hypothesis_template=params.hypothesis_template,  # refused by the kind, naming those that take it
        request_id=request_id,
    )


# The extract kinds that answer a zero-shot classification body, and the call each is sent.
ZERO_SHOT_CALLS: dict[str, Callable[[ZeroShotRequest, str, str | None], ExtractCall]] = {
    "zero_shot": _nli_call,
    "gliclass": _gliclass_call,
    "gliner2": _gliner2_call,
}


def labels(result: ExtractResult) -> list[LabelScore]:
    """Best first (ties in the result's order): GLiNER2's task answers its labels in request order."""
    found = sorted(result.items[0].labels or (), key=lambda s: -s.score)
    return [LabelScore(label=s.label, score=s.score) for s in found]


def text_classification_call(req: TextClassificationRequest, model: str, request_id: str | None = None) -> ExtractCall:
    params = req.parameters or TextClassificationParameters()
    return ExtractCall(
        model=model,
        items=[req.inputs],
        top_k=params.top_k,
        function_to_apply=params.function_to_apply,
        request_id=request_id,
    )


def _names(t: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(t))


# The parameters only one task's body has, by task.
_TASK_PARAMETERS = {
    "zero_shot": _names(ZeroShotParameters),
    "text_classification": _names(TextClassificationParameters),
    "token_classification": _names(TokenClassificationParameters),
}


def task_of(parameters: object) -> str | None:
    """The task a body's `parameters` name by their fields (zero_shot, text_classification or
    token_classification), or None when they name none (`{}`, null): the model's kind decides."""
    if not isinstance(parameters, dict):
        return None
    return next((task for task, names in _TASK_PARAMETERS.items() if names & parameters.keys()), None)
