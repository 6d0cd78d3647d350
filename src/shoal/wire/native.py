"""Native `/v1/encode`, `/v1/score` and `/v1/extract`: requests, responses, and their translation to calls.

Items carry an optional `id` (a string or an int64), echoed back as sent (`null` when absent); a
score item also carries `index`, its position in the request.

An item of any of the three (and a score's query) is a `text` or an `image`, exactly one. An image
is the file's bytes: in JSON a base64 string or a `data:image/...;base64,...` URL, in msgpack also
the raw bytes (`wire.images` reads them). The engine decodes and checks the image, and refuses a
modality the model does not read (an extract kind reads texts, or images for `image_labels`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET

from ..calls import (
    EncodeCall,
    EncodeResult,
    Entity,
    ExtractCall,
    ExtractResult,
    LabelScore,
    Record,
    Relation,
    ScoreCall,
    ScoreResult,
)
from .images import ImageData, input_of

OutputDtype = Literal["float32", "float16", "int8", "binary", "ubinary"]
OutputKind = Literal["dense", "sparse", "multivector"]

# Integer ids must survive msgpack and JSON round trips: int64.
ItemId = str | Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
# A request's deadline in seconds (the server has a default); past it, 504.
TimeoutS = Annotated[float, msgspec.Meta(gt=0, le=86400)]


class Usage(msgspec.Struct, omit_defaults=True):
    tokens: int
    generated_tokens: int | None = None  # extract on a generating model: new tokens written
    # What the model computed in (float32, bfloat16, float16, int8, int4); absent where not known.
    precision: str | None = None


def usage_of(result: EncodeResult | ScoreResult | ExtractResult) -> Usage:
    generated = getattr(result, "generated_tokens", 0) or None
    return Usage(tokens=result.num_tokens, generated_tokens=generated, precision=result.precision)


class Timings(msgspec.Struct):
    tokenize_ms: float
    queue_ms: float
    inference_ms: float
    total_ms: float  # 0 until the endpoint, which sees the whole request, fills it in


def timings_of(result: EncodeResult | ScoreResult | ExtractResult) -> Timings:
    """The phases of an engine result (seconds) in milliseconds."""
    ms = 1000.0
    return Timings(
        tokenize_ms=round(result.tokenize_s * ms, 3),
        queue_ms=round(result.queue_s * ms, 3),
        inference_ms=round(result.inference_s * ms, 3),
        total_ms=0.0,
    )


# --- /v1/encode ---------------------------------------------------------------------------------


class EncodeItem(msgspec.Struct, forbid_unknown_fields=True):
    """A `text` or an `image`, exactly one."""

    text: str | None = None
    image: ImageData = UNSET
    id: ItemId = None


class EncodeOptions(msgspec.Struct, forbid_unknown_fields=True):
    normalize: bool | None = None
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    output_dtype: OutputDtype = "float32"
    is_query: bool | None = None
    prompt_name: str | None = None
    truncate: bool = True
    # Which outputs to compute in the one forward pass; default: the card's first.
    outputs: Annotated[list[OutputKind], msgspec.Meta(min_length=1)] | None = None
    sparse_top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    return_tokens: bool = False  # sparse: the vocabulary token of each index
    timeout_s: TimeoutS | None = None


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: NonEmpty
    items: Annotated[list[EncodeItem], msgspec.Meta(min_length=1)]
    options: EncodeOptions = msgspec.field(default_factory=EncodeOptions)
    adapter: NonEmpty | None = None  # a LoRA adapter of the model (GET /v1/models/{id} lists them)


# The arrays below are numpy arrays on the server; a client decodes them as the msgpack map of an
# array (`codec.MsgpackArray`) or JSON's nested lists (`sdk.results.array_of`). `Any` keeps the
# schema open: both forms are the same array.
class SparseOut(msgspec.Struct, omit_defaults=True):
    indices: Any  # int32 array
    values: Any  # float32 array
    tokens: list[str] | None = None


class EncodedItem(msgspec.Struct, omit_defaults=True):
    id: ItemId
    dense: Any = None  # [dims] array
    sparse: SparseOut | None = None
    multivector: Any = None  # [tokens, dim] array
    truncated: bool = False  # cut at the model's max_length (sent only when true)


class EncodeResponse(msgspec.Struct):
    model: str
    items: list[EncodedItem]
    usage: Usage
    timings: Timings


# --- /v1/score ----------------------------------------------------------------------------------


class ScoreQuery(msgspec.Struct, forbid_unknown_fields=True):
    """A `text` or an `image`, exactly one."""

    text: NonEmpty | None = None
    image: ImageData = UNSET


class ScoreItem(msgspec.Struct, forbid_unknown_fields=True):
    """A `text` or an `image`, exactly one."""

    text: str | None = None
    image: ImageData = UNSET
    id: ItemId = None


class ScoreOptions(msgspec.Struct, forbid_unknown_fields=True):
    raw_scores: bool = False  # cross-encoders and LLM rerankers: the logit, no activation
    truncate: bool = True  # False: a (query, item) pair longer than the model takes is a 422
    max_tokens_per_doc: Annotated[int, msgspec.Meta(ge=1)] | None = None
    window_overlap_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    instruction: str | None = None
    timeout_s: TimeoutS | None = None
    unit_scores: bool = False  # each score mapped into 0..1 by its model kind's bound, order kept


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: NonEmpty
    query: NonEmpty | ScoreQuery  # a bare string (a text), or {"text": ...} or {"image": ...}
    items: Annotated[list[ScoreItem], msgspec.Meta(min_length=1)]
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    options: ScoreOptions = msgspec.field(default_factory=ScoreOptions)
    adapter: NonEmpty | None = None


class ScoredItem(msgspec.Struct, omit_defaults=True):
    id: ItemId
    index: int
    score: float
    truncated: bool = False
    num_windows: int = 1


class ScoreResponse(msgspec.Struct):
    model: str
    items: list[ScoredItem]  # best first
    usage: Usage
    timings: Timings


# --- /v1/extract --------------------------------------------------------------------------------


class ExtractItem(msgspec.Struct, forbid_unknown_fields=True):
    """A `text` or an `image`, exactly one (an `image_labels` model labels images, the others read texts)."""

    text: str | None = None
    image: ImageData = UNSET
    id: ItemId = None


# A text classifier's function over its logits (transformers' text-classification pipeline's names).
ClassifyFunction = Literal["softmax", "sigmoid", "none"]


class ExtractOptions(msgspec.Struct, forbid_unknown_fields=True):
    threshold: float | None = None  # 0..1; unset: the card's (GLiNER: 0.5)
    flat_ner: bool | None = None  # gliner; default true
    multi_label: bool | None = None  # gliner and zero_shot; default false
    max_span_width: int | None = None
    hypothesis_template: str | None = None
    aggregation: str | None = None
    top_k: int | None = None  # classify: the best this many labels; unset: all
    raw_scores: bool | None = None  # classify: the logits, no softmax or sigmoid
    # classify: in place of the function the model's config implies (transformers' pipeline's argument)
    function_to_apply: ClassifyFunction | None = None
    truncate: bool | None = None  # classify (default true): false makes an over-long text a 422
    max_new_tokens: int | None = None  # a generating model: new tokens per record at most (unset: the card's)
    timeout_s: TimeoutS | None = None


class ExtractRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: NonEmpty
    items: Annotated[list[ExtractItem], msgspec.Meta(min_length=1)]
    labels: list[str] = []
    # classify on a pair classifier: each item's second text (as many as items)
    text_pairs: list[str] | None = None
    # gliner2: the schema beside the entity types in `labels` (ExtractCall.schema says its form)
    schema: dict[str, Any] | None = None
    options: ExtractOptions = msgspec.field(default_factory=ExtractOptions)
    adapter: NonEmpty | None = None


class ExtractedItem(msgspec.Struct, omit_defaults=True):
    id: ItemId
    index: int
    entities: list[Entity] | None = None
    labels: list[LabelScore] | None = None
    classifications: dict[str, list[LabelScore]] | None = None  # gliner2: labels by classification task
    relations: dict[str, list[Relation]] | None = None  # gliner2: instances (head, tail) by relation type
    structures: dict[str, list[Record]] | None = None  # gliner2: records by structure
    # a generating model: the record it wrote (JSON that the request's schema allows; null when
    # max_new_tokens ended it first), and why it stopped ("stop", "length")
    data: Any = None
    finish_reason: str | None = None
    num_windows: int = 1
    truncated: bool = False


class ExtractResponse(msgspec.Struct):
    model: str
    items: list[ExtractedItem]
    usage: Usage
    timings: Timings


def extract_call(req: ExtractRequest, request_id: str | None = None) -> ExtractCall:
    opts = req.options
    return ExtractCall(
        model=req.model,
        items=[input_of(item.text, item.image, f"items[{i}]") for i, item in enumerate(req.items)],
        labels=req.labels,
        threshold=opts.threshold,
        flat_ner=opts.flat_ner,
        multi_label=opts.multi_label,
        max_span_width=opts.max_span_width,
        hypothesis_template=opts.hypothesis_template,
        aggregation=opts.aggregation,
        top_k=opts.top_k,
        raw_scores=opts.raw_scores,
        function_to_apply=opts.function_to_apply,
        text_pairs=req.text_pairs,
        schema=req.schema,
        truncate=opts.truncate,
        max_new_tokens=opts.max_new_tokens,
        request_id=request_id,
        timeout_s=opts.timeout_s,
        adapter=req.adapter,
    )


def extract_response(req: ExtractRequest, result: ExtractResult) -> ExtractResponse:
    items = [
        ExtractedItem(
            id=item.id,
            index=i,
            entities=out.entities,
            labels=out.labels,
            classifications=out.classifications,
            relations=out.relations,
            structures=out.structures,
            data=out.data,
            finish_reason=out.finish_reason,
            num_windows=out.num_windows,
            truncated=out.truncated,
        )
        for i, (item, out) in enumerate(zip(req.items, result.items))
    ]
    return ExtractResponse(model=req.model, items=items, usage=usage_of(result), timings=timings_of(result))


def encode_call(req: EncodeRequest, request_id: str | None = None) -> EncodeCall:
    opts = req.options
    return EncodeCall(
        model=req.model,
        items=[input_of(item.text, item.image, f"items[{i}]") for i, item in enumerate(req.items)],
        normalize=opts.normalize,
        dimensions=opts.dimensions,
        output_dtype=opts.output_dtype,
        is_query=opts.is_query,
        prompt_name=opts.prompt_name,
        truncate=opts.truncate,
        outputs=tuple(opts.outputs) if opts.outputs else None,
        sparse_top_k=opts.sparse_top_k,
        return_tokens=opts.return_tokens,
        request_id=request_id,
        timeout_s=opts.timeout_s,
        adapter=req.adapter,
    )


def score_call(req: ScoreRequest, request_id: str | None = None) -> ScoreCall:
    opts = req.options
    return ScoreCall(
        model=req.model,
        query=req.query if isinstance(req.query, str) else input_of(req.query.text, req.query.image, "query"),
        documents=[input_of(item.text, item.image, f"items[{i}]") for i, item in enumerate(req.items)],
        top_k=req.top_k,
        raw_scores=opts.raw_scores,
        unit_scores=opts.unit_scores,
        truncate=opts.truncate,
        max_tokens_per_doc=opts.max_tokens_per_doc,
        window_overlap_tokens=opts.window_overlap_tokens,
        instruction=opts.instruction,
        request_id=request_id,
        timeout_s=opts.timeout_s,
        adapter=req.adapter,
    )


def score_response(req: ScoreRequest, result: ScoreResult) -> ScoreResponse:
    items = [
        ScoredItem(
            id=req.items[out.index].id,
            index=out.index,
            score=out.score,
            truncated=out.truncated,
            num_windows=out.num_windows,
        )
        for out in result.items
    ]
    return ScoreResponse(model=req.model, items=items, usage=usage_of(result), timings=timings_of(result))
