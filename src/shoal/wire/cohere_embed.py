"""Cohere `/v2/embed` and `/v1/embed`: requests, their translation to one encode call, and responses.

`/v2/embed` and `/v1/embed` embed one of `texts`, `images` (data: URLs, with input_type "image",
as Cohere requires; texts may not take it) or, v2, `inputs`: an input's text parts are one text,
or an input is one image part (any input_type, as Cohere's embed-v4 takes them). Text and image
parts in one input are refused: Cohere fuses them into one vector, shoal's image models embed a
text or an image. The engine reads the images (and refuses them for a text-only model).
`input_type` picks the card's prompt for texts (search_query: the query prompt, search_document:
the document prompt, the others: none). Every embedding type is derived from one float32 forward
(the card's normalisation, `output_dimension` applied), so the types of one request agree:

    float    the float32 vector
    int8     scaled per vector so its largest component is ±127 (shoal's int8; Cohere calibrates
             its own int8 per model, so values differ from Cohere's, cosines are kept)
    uint8    int8 + 128, as uint8 (1..255; 128 is zero)
    ubinary  sign bits (> 0) packed 8 to a byte, big-endian bit order (numpy packbits), as uint8
    binary   ubinary - 128, as int8 (Cohere's and sentence-transformers' signed binary)
    base64   base64 of the float32 little-endian bytes of the vector, one string per text

`truncate`: END (the default) cuts a long text at the model's max_length, NONE refuses it (422),
START is refused (shoal cuts the end only). `max_tokens` at or over the model's max_length is
met by that cut; below it is refused (shoal does not cut encode inputs shorter). `priority` is
accepted and ignored.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import msgspec
import numpy as np

from ..calls import EncodeCall, EncodeResult, Input, Item
from ..errors import InputTooLong, InvalidRequest
from ..vectors import finish
from .cohere import ApiVersion
from .images import image_bytes

EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
# input_type -> EncodeCall.is_query (None: no prompt)
INPUT_TYPES: dict[str, bool | None] = {
    "search_query": True,
    "search_document": False,
    "classification": None,
    "clustering": None,
    "image": None,  # `images` (or image inputs): an image has no prompt
}
TEXT_INPUT_TYPES = [kind for kind in INPUT_TYPES if kind != "image"]
TRUNCATE_MODES = ("NONE", "START", "END")
# What each source of inputs holds, and what an empty one lacks.
_SOURCES = {
    "texts": ("`texts` (strings)", "one string"),
    "inputs": ("`inputs` (content parts)", "one input"),
    "images": ("`images` (image data: URLs)", "one image"),
}
# An image as Cohere sends it (`images.image_bytes` reads it).
DataUrl = Annotated[
    str,
    msgspec.Meta(
        description="An image file as a data:image/...;base64,... URL (bare base64 is accepted too). "
        "URLs are not fetched."
    ),
]


class ImageUrl(msgspec.Struct, forbid_unknown_fields=True):
    url: DataUrl
    detail: str | None = None  # accepted, ignored


class EmbedContent(msgspec.Struct, forbid_unknown_fields=True):
    """One part of a v2 input: `{"type": "text", "text"}` or `{"type": "image_url", "image_url": {"url"}}`."""

    type: str
    text: str | None = None
    image_url: ImageUrl | DataUrl | None = None


class EmbedInput(msgspec.Struct, forbid_unknown_fields=True):
    content: list[EmbedContent]


class _EmbedRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    texts: list[str] | None = None
    images: list[DataUrl] | None = None
    input_type: str | None = None  # None: no prompt
    embedding_types: list[str] | None = None  # None: ["float"]
    truncate: str | None = None  # None: END

    def inputs_of(self) -> list[Input]:
        """What to embed, in order: texts as strings, images as `Item(image=...)`."""
        source = self._source({"texts": self.texts, "images": self.images})
        return self._images() if source == "images" else list(self.texts or [])

    def _source(self, sources: dict[str, list[Any] | None]) -> str:
        """The one source of inputs sent (an empty list beside a non-empty one counts as unsent);
        an InvalidRequest for none, an empty one, two, or an input_type that does not fit it."""
        given = [name for name, values in sources.items() if values]
        if len(given) > 1:
            raise InvalidRequest(
                f"send either `{given[0]}` or `{given[1]}`, not both", details={"path": f"$.{given[1]}"}
            )
        if not given:
            sent = [name for name, values in sources.items() if values is not None]
            if not sent:
                wanted = " or ".join(_SOURCES[name][0] for name in sources)
                raise InvalidRequest(f"nothing to embed: send {wanted}", details={"path": "$.texts"})
            raise InvalidRequest(
                f"`{sent[0]}` is empty: send at least {_SOURCES[sent[0]][1]}", details={"path": f"$.{sent[0]}"}
            )
        if given[0] == "images" and self.input_type != "image":
            raise InvalidRequest(
                f"`images` needs input_type 'image', not {self.input_type!r}: Cohere embeds `images` with it",
                details={"path": "$.input_type"},
            )
        if given[0] == "texts" and self.input_type == "image":
            raise InvalidRequest(
                "input_type 'image' is for `images` (data: URLs), not texts: send the images there, or send "
                f"texts with input_type one of {', '.join(TEXT_INPUT_TYPES)}",
                details={"path": "$.input_type"},
            )
        return given[0]

    def _images(self) -> list[Input]:
        return [Item(image=image_bytes(url, f"images[{i}]")) for i, url in enumerate(self.images or [])]

    def types(self) -> tuple[str, ...]:
        """The requested embedding types, in order, without repeats."""
        if self.embedding_types is None:
            return ("float",)
        if not self.embedding_types:
            raise InvalidRequest(
                f"`embedding_types` is empty: name one or more of {', '.join(EMBEDDING_TYPES)}",
                details={"path": "$.embedding_types", "allowed": list(EMBEDDING_TYPES)},
            )
        for i, kind in enumerate(self.embedding_types):
            if kind not in EMBEDDING_TYPES:
                raise InvalidRequest(
                    f"unknown embedding type {kind!r}: `embedding_types` takes {', '.join(EMBEDDING_TYPES)}",
                    details={"path": f"$.embedding_types[{i}]", "allowed": list(EMBEDDING_TYPES)},
                )
        return tuple(dict.fromkeys(self.embedding_types))

    def is_query(self) -> bool | None:
        kind = self.input_type
        if kind is None:
            return None
        if kind in INPUT_TYPES:
            return INPUT_TYPES[kind]
        raise InvalidRequest(
            f"unknown input_type {kind!r}: send one of {', '.join(INPUT_TYPES)}",
            details={"path": "$.input_type", "allowed": list(INPUT_TYPES)},
        )

    def truncates(self) -> bool:
        mode = self.truncate or "END"
        if mode == "START":
            raise InvalidRequest(
                "truncate START is not supported: shoal cuts long texts at the end; send END "
                "(the default) or NONE (a text too long for the model is then a 422)",
                details={"path": "$.truncate", "allowed": ["NONE", "END"]},
            )
        if mode not in TRUNCATE_MODES:
            raise InvalidRequest(
                f"unknown truncate {mode!r}: send NONE, START or END",
                details={"path": "$.truncate", "allowed": list(TRUNCATE_MODES)},
            )
        return mode == "END"


class EmbedRequest(_EmbedRequest, kw_only=True):
    """`/v1/embed`. `model` is optional in Cohere's v1 but required here: shoal has no default embedder."""

    model: str | None = None

    def model_of(self) -> str:
        if not self.model:
            raise InvalidRequest(
                "no `model`: name the embedding model to use (`GET /v1/models` lists them)", details={"path": "$.model"}
            )
        return self.model


class EmbedV2Request(_EmbedRequest, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    inputs: list[EmbedInput] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    output_dimension: Annotated[int, msgspec.Meta(ge=1)] | None = None
    priority: int | None = None  # accepted, ignored

    def inputs_of(self) -> list[Input]:
        """`texts`, `images`, or each of `inputs` as its text parts joined by newlines or its one image part."""
        source = self._source({"texts": self.texts, "inputs": self.inputs, "images": self.images})
        if source == "inputs":
            return [_input_of(i, item) for i, item in enumerate(self.inputs or [])]
        return self._images() if source == "images" else list(self.texts or [])

    def check_max_tokens(self, max_length: int) -> None:
        """`max_tokens` is met by the model's own cut when it is at least `max_length`; shorter is refused."""
        if self.max_tokens is not None and self.max_tokens < max_length:
            raise InvalidRequest(
                f"max_tokens {self.max_tokens} is below model {self.model}'s max_length of {max_length} tokens: "
                f"shoal cuts encode inputs at the model's max_length only; omit max_tokens or send at least "
                f"{max_length}",
                details={"path": "$.max_tokens", "min": max_length},
            )


def _input_of(index: int, item: EmbedInput) -> Input:
    name = f"inputs[{index}]"
    if not item.content:
        raise InvalidRequest(
            f"{name} has no content: send at least one text part or one image part",
            details={"path": f"$.{name}.content"},
        )
    texts: list[str] = []
    images: list[bytes] = []
    for j, part in enumerate(item.content):
        where = f"{name}.content[{j}]"
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "image_url" and part.image_url is not None:
            if isinstance(part.image_url, str):  # the URL itself, as some clients send it
                images.append(image_bytes(part.image_url, f"{where}.image_url"))
            else:
                images.append(image_bytes(part.image_url.url, f"{where}.image_url.url"))
        else:
            raise InvalidRequest(
                f'{where} must be {{"type": "text", "text": "..."}} or '
                f'{{"type": "image_url", "image_url": {{"url": "data:image/...;base64,..."}}}}',
                details={"path": f"$.{where}"},
            )
    if texts and images:
        raise InvalidRequest(
            f"{name} has text and image parts: Cohere fuses them into one embedding, and shoal embeds a text "
            "or an image per input; send them as separate inputs",
            details={"path": f"$.{name}.content"},
        )
    if len(images) > 1:
        raise InvalidRequest(
            f"{name} has {len(images)} image parts: shoal embeds one image per input; send each as its own input",
            details={"path": f"$.{name}.content"},
        )
    return Item(image=images[0]) if images else "\n".join(texts)


def texts_in(inputs: list[Input]) -> list[str]:
    """The texts among `inputs` (what a response's `texts` echoes)."""
    return [value for value in inputs if isinstance(value, str)]


def encode_call(req: _EmbedRequest, model: str, inputs: list[Input], request_id: str | None = None) -> EncodeCall:
    """One float32 dense forward; every embedding type is derived from it (`embeddings_by_type`).
    Checks every option first, so a bad one costs no forward."""
    req.types()
    return EncodeCall(
        model=model,
        items=inputs,
        is_query=req.is_query(),
        truncate=req.truncates(),
        dimensions=getattr(req, "output_dimension", None),
        outputs=("dense",),
        request_id=request_id,
    )


def too_long(error: InputTooLong) -> InputTooLong:
    """The engine's refusal of a too-long text, in this API's words (`truncate`: NONE, END)."""
    index, max_length = error.details.get("index"), error.details.get("max_length")
    if index is None or max_length is None:
        return error
    return InputTooLong(
        f"texts[{index}] is longer than the model's max_length of {max_length} tokens: shorten it, "
        "or send truncate END (the default) to cut it at the end",
        details=error.details,
    )


def embeddings_by_type(vectors: list[np.ndarray], types: tuple[str, ...]) -> dict[str, list[Any]]:
    """Each requested type of every vector (float32 `[dims]` each), as the module's notes define them."""
    out: dict[str, list[Any]] = {}
    for kind in types:
        if kind == "float":
            out[kind] = [np.asarray(v, dtype=np.float32) for v in vectors]
        elif kind in ("int8", "uint8"):
            signed = [finish(v, dimensions=None, normalize=False, output_dtype="int8") for v in vectors]
            out[kind] = signed if kind == "int8" else [(s.astype(np.int16) + 128).astype(np.uint8) for s in signed]
        elif kind in ("binary", "ubinary"):
            out[kind] = [finish(v, dimensions=None, normalize=False, output_dtype=kind) for v in vectors]
        elif kind == "base64":
            out[kind] = [
                base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii") for v in vectors
            ]
        else:
            raise ValueError(f"unknown embedding type {kind!r}")
    return out


class EmbedBilledUnits(msgspec.Struct):
    input_tokens: int


class EmbedMeta(msgspec.Struct):
    api_version: ApiVersion
    billed_units: EmbedBilledUnits


class EmbedByTypeResponse(msgspec.Struct):
    """v2, and v1 with `embedding_types`: `embeddings` maps each type to one array per text."""

    id: str
    embeddings: dict[str, list[Any]]
    texts: list[str]
    meta: EmbedMeta
    response_type: str = "embeddings_by_type"


class EmbedFloatsResponse(msgspec.Struct):
    """v1 without `embedding_types`: one float array per text."""

    id: str
    embeddings: list[np.ndarray]
    texts: list[str]
    meta: EmbedMeta
    response_type: str = "embeddings_floats"


def embed_response(
    req: _EmbedRequest, version: str, texts: list[str], result: EncodeResult, request_id: str
) -> EmbedByTypeResponse | EmbedFloatsResponse:
    """v2 always answers by type; v1 answers floats unless `embedding_types` was sent."""
    if version == "1" and req.embedding_types is None:
        return EmbedFloatsResponse(
            id=request_id,
            embeddings=embeddings_by_type(result.vectors, ("float",))["float"],
            texts=texts,
            meta=_embed_meta(version, result),
        )
    return embed_by_type_response(req, version, texts, result, request_id)


def embed_by_type_response(
    req: _EmbedRequest, version: str, texts: list[str], result: EncodeResult, request_id: str
) -> EmbedByTypeResponse:
    """Every requested type of every vector (v2, and v1 with `embedding_types`)."""
    return EmbedByTypeResponse(
        id=request_id,
        embeddings=embeddings_by_type(result.vectors, req.types()),
        texts=texts,
        meta=_embed_meta(version, result),
    )


def _embed_meta(version: str, result: EncodeResult) -> EmbedMeta:
    billed = EmbedBilledUnits(input_tokens=result.num_tokens)
    return EmbedMeta(api_version=ApiVersion(version=version), billed_units=billed)
