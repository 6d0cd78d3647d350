"""Native `/v1/encode`, `/v1/score` and `/v1/extract`: requests, responses, and their translation to calls.

Items carry an optional `id` (a string or an int64), echoed back as sent (`null` when absent); a
score item also carries `index`, its position in the request.

An encode or score item (and a score's query) is a `text` or an `image`, exactly one. An image is
the file's bytes: in JSON a base64 string or a `data:image/...;base64,...` URL, in msgpack either
of those or the raw bytes (bin). The server fetches no URL. This module only turns the client's
encoding into bytes (`image_bytes`); the engine decodes and checks the image itself.
"""

from __future__ import annotations

import base64
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET

from ..calls import (
    EncodeCall,
    EncodeResult,
    Entity,
    ExtractCall,
    ExtractResult,
    Input,
    Item,
    LabelScore,
    ScoreCall,
    ScoreResult,
)
from ..errors import InvalidRequest

OutputDtype = Literal["float32", "float16", "int8", "binary"]
OutputKind = Literal["dense", "sparse", "multivector"]

# Integer ids must survive msgpack and JSON round trips: int64.
ItemId = str | Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
# A request's deadline in seconds (the server has a default); past it, 504.
TimeoutS = Annotated[float, msgspec.Meta(gt=0, le=86400)]
# An image field (`image_bytes` reads it). msgspec allows no union of `str` and `bytes`, and one
# struct serves both codecs, so the type is Any and the schema says what JSON takes; UNSET (not
# sent) is omitted when a client encodes the struct, so a text item's body has no `image`.
ImageData = Annotated[
    Any,
    msgspec.Meta(
        description="An image file (PNG, JPEG, WebP, GIF, BMP or TIFF): its bytes in base64, or a "
        "data:image/...;base64,... URL; in msgpack also the raw bytes. URLs are not fetched.",
        extra_json_schema={"type": "string"},
    ),
]


class Usage(msgspec.Struct):
    tokens: int


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
    text: str
    id: ItemId = None


class ExtractOptions(msgspec.Struct, forbid_unknown_fields=True):
    threshold: float | None = None  # 0..1; unset: the card's (GLiNER: 0.5)
    flat_ner: bool | None = None  # gliner; default true
    multi_label: bool | None = None  # gliner and zero_shot; default false
    max_span_width: int | None = None
    hypothesis_template: str | None = None
    aggregation: str | None = None
    timeout_s: TimeoutS | None = None


class ExtractRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: NonEmpty
    items: Annotated[list[ExtractItem], msgspec.Meta(min_length=1)]
    labels: list[str] = []
    options: ExtractOptions = msgspec.field(default_factory=ExtractOptions)
    adapter: NonEmpty | None = None


class ExtractedItem(msgspec.Struct, omit_defaults=True):
    id: ItemId
    index: int
    entities: list[Entity] | None = None
    labels: list[LabelScore] | None = None
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
        items=[item.text for item in req.items],
        labels=req.labels,
        threshold=opts.threshold,
        flat_ner=opts.flat_ner,
        multi_label=opts.multi_label,
        max_span_width=opts.max_span_width,
        hypothesis_template=opts.hypothesis_template,
        aggregation=opts.aggregation,
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
            num_windows=out.num_windows,
            truncated=out.truncated,
        )
        for i, (item, out) in enumerate(zip(req.items, result.items))
    ]
    return ExtractResponse(
        model=req.model, items=items, usage=Usage(tokens=result.num_tokens), timings=timings_of(result)
    )


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
    return ScoreResponse(
        model=req.model, items=items, usage=Usage(tokens=result.num_tokens), timings=timings_of(result)
    )


# --- images ---------------------------------------------------------------------------------------

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")  # base64 has no ':', so a match is a URL
_URL_SAFE = str.maketrans("-_", "+/")  # base64url's alphabet to the standard one
_SEND = "send the image file's bytes as base64 or as a data:image/...;base64,... URL"


def input_of(text: str | None, image: object, name: str) -> Input:
    """The call's input for an item that carries a `text` or an `image` (`name`: `items[3]`, `query`);
    an InvalidRequest naming it unless exactly one is set, or if the image is not one `image_bytes` reads."""
    has_image = image is not UNSET and image is not None
    if text is not None and has_image:
        raise InvalidRequest(
            f"{name} has both a `text` and an `image`: send one of them", details={"path": f"$.{name}"}
        )
    if text is not None:
        return text
    if not has_image:
        raise InvalidRequest(
            f"{name} has neither a `text` nor an `image`: send one of them", details={"path": f"$.{name}"}
        )
    return Item(image=image_bytes(image, f"{name}.image"))


def image_bytes(value: object, name: str) -> bytes:
    """The image file's bytes an image field carries: raw bytes (msgpack's bin) as they are, a
    string as base64 (whitespace, missing padding and base64url's alphabet forgiven) or a base64
    `data:image/...` URL. Anything else is an InvalidRequest naming `name` (`items[3].image`): a
    remote URL (the server fetches none), bad base64, a data: URL not in base64 or not of an image type.
    """
    if isinstance(value, bytes):
        return value
    details = {"path": f"$.{name}"}
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} is {_json_type(value)}, not a string: {_SEND}", details=details)
    scheme = _SCHEME.match(value)
    if scheme is None:
        return _base64(value, name, details)
    if scheme.group(1).lower() != "data":
        raise InvalidRequest(
            f"{name} is a URL ({scheme.group(0).lower()}...), and the server does not fetch URLs: {_SEND}",
            details=details,
        )
    header, comma, payload = value[scheme.end() :].partition(",")
    if not comma:
        raise InvalidRequest(f"{name} is a data: URL with no ',' before its data: {_SEND}", details=details)
    params = [param.strip().lower() for param in header.split(";")]
    media = params[0] or "text/plain"  # a data: URL's default type
    if not media.startswith("image/"):
        raise InvalidRequest(f"{name} is a data: URL of type {media!r}, not an image: {_SEND}", details=details)
    if params[-1] != "base64" or len(params) < 2:
        raise InvalidRequest(
            f"{name} is a data: URL that is not base64 (its type has no ';base64'): {_SEND}", details=details
        )
    return _base64(payload, name, details)


def _base64(text: str, name: str, details: dict[str, Any]) -> bytes:
    try:  # the common case in one pass; the forgiving one below copies the text twice more
        return base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error, or a non-ASCII character
        pass
    compact = "".join(text.split()).translate(_URL_SAFE)
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except ValueError as exc:
        raise InvalidRequest(f"{name} is not valid base64 ({exc}): {_SEND}", details=details) from None


def _json_type(value: object) -> str:
    kinds = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)
