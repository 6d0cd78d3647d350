"""The engine's public types: calls in, results out, as msgspec Structs.

One tagged union of calls (`verb` names the struct) and one of results, torch-free, so the same
bytes travel in process and on the cluster's wire. Arrays stay numpy arrays in process; `encode`
writes them as `{dtype, shape, data}` with raw little-endian bytes and `decode_*` reads them back.

    Call ─┬ EncodeCall
          ├ ScoreCall
          └ ExtractCall
    Result ─┬ EncodeResult
            ├ ScoreResult
            ├ ExtractResult
            └ ErrorResult         a ShoalError as data: `error()` re-raises it as its own class

Inputs are modality-neutral: an `items` entry (a score's query or document) is an `Item` with its
`text` or its `image` (the file's bytes), or a bare string, the short form of a text item. What
modalities a model reads is its card's `modalities`; the engine refuses the others by item.

Every call carries `request_id` (for logs and error bodies) and `timeout_s`, the caller's budget:
the engine turns it into a deadline at admission and drops work that outlives it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import msgspec
import numpy as np

from .errors import InvalidRequest, ShoalError, error_from_code

Modality: TypeAlias = Literal["text", "image"]


class Item(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One input of a call that is more than a string: a text, or an image as its file's bytes
    (PNG, JPEG...; base64 in JSON). Exactly one is set."""

    text: str | None = None
    image: bytes | None = None

    @property
    def modality(self) -> Modality:
        return "image" if self.image is not None else "text"


# An input: a bare string is a text item.
Input: TypeAlias = str | Item


def modality_of(value: Input) -> Modality:
    return value.modality if isinstance(value, Item) else "text"


def text_of(value: Input) -> str | None:
    """The text of a text input; None for any other modality."""
    if isinstance(value, str):
        return value
    return value.text if value.image is None else None


class Call(msgspec.Struct, kw_only=True, frozen=True, tag_field="verb"):
    request_id: str | None = None
    timeout_s: float | None = None  # None: the server's default deadline
    adapter: str | None = None  # a LoRA adapter of the model (its card's `adapters`); None: the base model
    # Whether serving it may download the model's weights (where the server allows downloads at
    # all); the HTTP API sets it from the caller's token (the `download` scope).
    may_download: bool = True


class EncodeCall(Call, frozen=True, tag="encode"):
    """Encode items into dense, sparse and/or multi-vector outputs, one per item."""

    model: str
    items: Sequence[Input]  # decoded as a list
    normalize: bool | None = None  # None: as the card says
    dimensions: int | None = None  # Matryoshka truncation
    output_dtype: str = "float32"
    is_query: bool | None = None
    prompt_name: str | None = None
    truncate: bool = True
    outputs: tuple[str, ...] | None = None  # None: the card's first output
    sparse_top_k: int | None = None
    return_tokens: bool = False


class ScoreCall(Call, frozen=True, tag="score"):
    """Score documents against one query; the result ranks them, best first.

    How depends on the card: a cross-encoder or an LLM reranker runs each (query, document) pair
    as one sequence; a dense card scores by cosine, a sparse card by dot product, a multi-vector
    card by MaxSim (the query tokenized as a query, the documents as documents).
    """

    model: str
    query: Input
    documents: Sequence[Input]  # decoded as a list
    top_k: int | None = None  # None: every document, ranked
    raw_scores: bool = False  # cross-encoders and LLM rerankers: the logit, no activation
    truncate: bool = True  # False: a pair (or document) longer than the model takes is a 400
    # Cut each document to this many tokens before scoring (Cohere's max_tokens_per_doc).
    max_tokens_per_doc: int | None = None
    # Long documents: score overlapping windows of this many tokens' overlap and keep each
    # document's best window, instead of truncating. None: truncate.
    window_overlap_tokens: int | None = None
    instruction: str | None = None  # LLM rerankers: replaces the card's default instruction
    # Each score mapped into 0..1 by its kind's own bound, the order kept (engine/tasks/score.py:
    # unit_scores), so scores of different kinds of model read alike (Cohere's relevance_score).
    unit_scores: bool = False


class ExtractCall(Call, frozen=True, tag="extract"):
    """Extract entities (span and token-classification NER) or labels (zero-shot classification)
    from each item. How depends on the card's `extract.kind`:

        gliner      entities of the requested `labels` (zero-shot span NER)
        token_class entities of the model's own labels (`labels`, if sent, keeps only those)
        zero_shot   a score per requested label for each text (NLI entailment)
        classify    a score per label of the model's own (text classification)
        gliner2     entities of the `labels`, the `schema`'s relations, classification tasks and
                    structures (GLiNER2)
        glirel      relations of the `labels` types between the entities the `schema` gives (GLiREL)

    Options left None take the card's (or the kind's) default.
    """

    model: str
    items: Sequence[Input]  # decoded as a list
    labels: list[str] = []
    threshold: float | None = None  # minimum score of an entity (or, multi_label, of a label)
    flat_ner: bool | None = None  # gliner (default true): no overlapping entities; false: nested ones are kept
    multi_label: bool | None = None  # gliner: a span may carry several labels; zero_shot: labels scored on their own
    max_span_width: int | None = None  # gliner: longest entity in words
    hypothesis_template: str | None = None  # zero_shot: "{}" is replaced by the label
    aggregation: str | None = None  # token_class: simple | first | max | average
    top_k: int | None = None  # classify: the best this many labels (default: all); glirel: types per entity pair
    raw_scores: bool | None = None  # classify: the logits, no softmax or sigmoid
    # classify: "softmax", "sigmoid" or "none" in place of the function the model's config implies
    function_to_apply: str | None = None
    text_pairs: list[str] | None = None  # classify: each item's second text (a pair classifier)
    truncate: bool | None = None  # classify (default true): false makes an over-long text a 422
    # gliner2: what the schema holds beside the entity types (`labels`), a subset of the gliner2
    # package's schema dict: {"entity_descriptions": {type: text}, "relations": [{name: {"head": "",
    # "tail": ""}}], "relation_descriptions": {name: text}, "classifications": [{"task": name,
    # "labels": [label, ...] or {label: description}, "multi_label", "cls_threshold", "top_k",
    # "class_act", "prompt", "examples"}], "structures": {name: {"fields": [{"name", "dtype",
    # "choices", "description", "threshold"} or "name::dtype::description"]}}}
    # (engine/tasks/gliner2_schema.py). glirel: each item's entities,
    # {"entities": [[{"start": int, "end": int, "label": str}, ...], ...]} in character offsets of
    # the item's text (engine/tasks/extract_glirel.py)
    schema: dict[str, Any] | None = None
    # generate: the JSON Schema each item's record must follow is `schema`; new tokens at most
    # (None: the card's generate.max_new_tokens)
    max_new_tokens: int | None = None


class Message(msgspec.Struct, frozen=True):
    """One chat message: who says it ("system", "user", "assistant") and what."""

    role: str
    content: str


class GenerateCall(Call, frozen=True, tag="generate"):
    """Generate text after `messages` (framed by the model's chat template, the assistant's turn
    next) or after a raw `prompt` (exactly one of them). The output may be constrained: to JSON
    that `json_schema` allows, to any JSON object (`json_object`), to a `regex`, or to one of
    `choice`; unconstrained it runs to an end-of-sequence token, a `stop` string or
    `max_new_tokens`. `temperature` 0 is greedy; above it, sampling (top-p) from `seed` if given."""

    model: str
    messages: list[Message] | None = None
    prompt: str | None = None
    max_new_tokens: int | None = None  # None: the card's generate.max_new_tokens
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None


class SparseVector(msgspec.Struct, frozen=True, omit_defaults=True):
    indices: np.ndarray  # [k] int32 vocabulary ids, heaviest first
    values: np.ndarray  # [k] float32
    tokens: list[str] | None = None


class EncodedItem(msgspec.Struct, frozen=True, omit_defaults=True):
    """One item's outputs; those not asked for are None."""

    dense: np.ndarray | None = None  # [dims]
    sparse: SparseVector | None = None
    multivector: np.ndarray | None = None  # [tokens kept, dim]
    token_states: np.ndarray | None = None  # [tokens, hidden]: the encoder's last states, unpooled
    truncated: bool = False  # the text was cut at the model's max_length to fit


class Result(msgspec.Struct, kw_only=True, frozen=True, tag_field="verb"):
    request_id: str | None = None
    # What the model computed in: float32, bfloat16, float16, int8 or int4 (engine/precision.py chose it).
    precision: str | None = None


class EncodeResult(Result, frozen=True, tag="encode"):
    items: list[EncodedItem]
    num_tokens: int
    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0

    @property
    def vectors(self) -> list[np.ndarray]:
        """The dense vectors, in item order (ValueError if the call asked for no dense output)."""
        vectors = [item.dense for item in self.items if item.dense is not None]
        if len(vectors) != len(self.items):
            raise ValueError("this result has no dense vectors: its call asked for other outputs")
        return vectors


class ScoredItem(msgspec.Struct, frozen=True, omit_defaults=True):
    index: int  # the document's position in the call
    score: float
    truncated: bool = False  # the document (or pair) was cut to fit; False when windows covered it
    num_windows: int = 1  # windows scored for it (window_overlap_tokens set, document long)


class ScoreResult(Result, frozen=True, tag="score"):
    items: list[ScoredItem]  # best first; at most top_k
    num_tokens: int
    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0


class Entity(msgspec.Struct, frozen=True):
    text: str  # text[start:end] of the item's text
    label: str
    score: float
    start: int  # character offsets into the item's text (Python str indices: code points)
    end: int


class LabelScore(msgspec.Struct, frozen=True):
    label: str
    score: float


class RelationSpan(msgspec.Struct, frozen=True):
    text: str  # text[start:end] of the item's text
    score: float
    start: int  # character offsets into the item's text
    end: int


class Relation(msgspec.Struct, frozen=True, omit_defaults=True):
    """One instance of a relation type: the span that is its head and the span that is its tail."""

    head: RelationSpan
    tail: RelationSpan
    score: float | None = None  # glirel: the relation's own score (its given spans carry it too)


class FieldValue(msgspec.Struct, frozen=True, omit_defaults=True):
    """A structure field's value: a span of the text (with its offsets), or one of the field's
    choices (no offsets)."""

    text: str
    score: float
    start: int | None = None  # character offsets into the item's text, for a span
    end: int | None = None


# A structure's record: each field's value (dtype "str": one value or None; "list": every one found)
Record = dict[str, FieldValue | list[FieldValue] | None]


class ExtractedItem(msgspec.Struct, frozen=True, omit_defaults=True):
    """One text's entities (in order of start) or, for zero-shot classification, its labels (best first)."""

    entities: list[Entity] | None = None
    labels: list[LabelScore] | None = None
    # gliner2: each classification task's labels by task name (`labels` too when there is one task)
    classifications: dict[str, list[LabelScore]] | None = None
    # gliner2, glirel: each relation type's instances by type name (every type asked for, [] when none)
    relations: dict[str, list[Relation]] | None = None
    # gliner2: each structure's records by structure name (every structure asked for, [] when none)
    structures: dict[str, list[Record]] | None = None
    num_windows: int = 1  # windows the text was read in (long texts: overlapping windows, merged)
    truncated: bool = False  # zero_shot: the text was cut to fit next to the hypothesis
    # generate: the record the decoder wrote (parsed JSON that the call's schema allows), and why it
    # stopped ("stop": complete; "length": max_new_tokens came first and `data` is None)
    data: Any = None
    finish_reason: str | None = None


class ExtractResult(Result, frozen=True, tag="extract"):
    items: list[ExtractedItem]
    num_tokens: int
    generated_tokens: int = 0  # generate: new tokens written (num_tokens: the prompts')
    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0


class GenerateResult(Result, frozen=True, tag="generate"):
    text: str
    # "stop" (an end-of-sequence token, a stop string, a complete constrained output), "length"
    # (max_new_tokens), "deadline", "cancelled"
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0
    first_token_s: float = 0.0  # from the call's start to its first new token


@dataclass
class Generated:
    """A generation as far as it has come (what `stream` yields): its new tokens and their text
    (the text stops before a stop string), and why it ended (None while it runs)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    first_token_at: float | None = None  # time.monotonic() of its first new token


async def stream_updates(
    run: Callable[[Callable[[Generated], None]], Awaitable[Any]],
) -> AsyncIterator[Generated | GenerateResult]:
    """A generation as it comes, from `run(on_update)` (the engine's or the cluster gateway's):
    each `Generated` it reports, then the GenerateResult it returns (or its error, raised). Leaving
    the iteration early cancels `run` (the generation ends and frees its KV cache slot)."""
    updates: asyncio.Queue[Any] = asyncio.Queue()
    end = object()
    task = asyncio.ensure_future(run(updates.put_nowait))
    task.add_done_callback(lambda _: updates.put_nowait(end))
    try:
        while (item := await updates.get()) is not end:
            yield item
        result = task.result()  # raises the call's error
        if not isinstance(result, GenerateResult):
            raise TypeError(f"a generation ended in a {type(result).__name__}")
        yield result
    finally:
        if not task.done():
            task.cancel()


class ErrorResult(Result, frozen=True, tag="error"):
    code: str
    message: str
    details: dict[str, Any] = {}
    retry_after_s: float | None = None

    @classmethod
    def of(cls, error: ShoalError, request_id: str | None = None) -> ErrorResult:
        return cls(
            code=error.code,
            message=error.message,
            details=error.details,
            retry_after_s=error.retry_after_s,
            request_id=request_id,
        )

    def error(self) -> ShoalError:
        return error_from_code(self.code, self.message, self.details, self.retry_after_s)


AnyCall: TypeAlias = EncodeCall | ScoreCall | ExtractCall | GenerateCall
AnyResult: TypeAlias = EncodeResult | ScoreResult | ExtractResult | GenerateResult | ErrorResult


def timeout_of(call: Call, default_s: float) -> float:
    """The call's budget in seconds (`default_s` when it names none); InvalidRequest unless > 0."""
    timeout_s = default_s if call.timeout_s is None else call.timeout_s
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidRequest(
            f"timeout_s must be a number of seconds > 0, not {timeout_s!r}", details={"option": "timeout_s"}
        )
    return float(timeout_s)


# --- codec ---------------------------------------------------------------------------------------


def _enc_hook(obj: object) -> dict[str, object]:
    if isinstance(obj, np.ndarray):
        little = np.ascontiguousarray(obj.astype(obj.dtype.newbyteorder("<"), copy=False))
        return {"dtype": obj.dtype.name, "shape": list(obj.shape), "data": little.tobytes()}
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(typ: type, obj: object) -> np.ndarray:
    if typ is np.ndarray and isinstance(obj, dict):  # the map `_enc_hook` wrote
        dtype = np.dtype(obj["dtype"]).newbyteorder("<")
        array: np.ndarray = np.frombuffer(obj["data"], dtype=dtype).reshape(obj["shape"])
        return array
    raise NotImplementedError(f"cannot decode {typ}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_call_decoder = msgspec.msgpack.Decoder(AnyCall, dec_hook=_dec_hook)
_result_decoder = msgspec.msgpack.Decoder(AnyResult, dec_hook=_dec_hook)


def encode(obj: Call | Result) -> bytes:
    """msgpack bytes of a call or a result (arrays as raw little-endian bytes)."""
    return _encoder.encode(obj)


def decode_call(data: bytes) -> AnyCall:
    return _call_decoder.decode(data)


def decode_result(data: bytes) -> AnyResult:
    return _result_decoder.decode(data)
