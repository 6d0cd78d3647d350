"""Wire types and codecs: what crosses the HTTP boundary, in JSON or msgpack.

Requests are msgspec Structs, so decoding validates types and rejects unknown fields with a message
that names the path (`$.options.foo`). Arrays in responses are numpy arrays until encoding:
msgpack carries them as `{dtype, shape, data}` with raw little-endian bytes; JSON as nested lists.
No torch, no web framework here.
"""

from __future__ import annotations

import base64
import enum
import re
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from .errors import InvalidRequest, UnsupportedMediaType

JSON = "application/json"
MSGPACK = "application/msgpack"
_MSGPACK_ALIASES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")

OutputDtype = Literal["float32", "float16", "int8", "binary"]
OutputKind = Literal["dense", "sparse", "multivector"]


class Format(enum.Enum):
    JSON = JSON
    MSGPACK = MSGPACK


def format_of_content_type(content_type: str | None) -> Format:
    """The body format a Content-Type names; a missing header means JSON."""
    media = (content_type or JSON).split(";")[0].strip().lower()
    if media in ("application/json", "text/json", ""):
        return Format.JSON
    if media in _MSGPACK_ALIASES:
        return Format.MSGPACK
    raise UnsupportedMediaType(
        f"unsupported Content-Type {media!r}: send application/json or application/msgpack",
        details={"content_type": media},
    )


def format_of_accept(accept: str | None, default: Format) -> Format:
    """The response format: msgpack or JSON when Accept names one, else the request's format."""
    if not accept:
        return default
    media = [part.split(";")[0].strip().lower() for part in accept.split(",")]
    if any(m in _MSGPACK_ALIASES for m in media):
        return Format.MSGPACK
    if JSON in media:
        return Format.JSON
    return default


# --- native /v1/encode --------------------------------------------------------------------------


# Integer ids must survive msgpack and JSON round trips: int64.
ItemId = str | Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None


class EncodeItem(msgspec.Struct, forbid_unknown_fields=True):
    text: str
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
    # This request's deadline in seconds (the server has a default); past it, 504.
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = None


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    items: Annotated[list[EncodeItem], msgspec.Meta(min_length=1)]
    options: EncodeOptions = msgspec.field(default_factory=EncodeOptions)


class SparseOut(msgspec.Struct, omit_defaults=True):
    indices: Any  # int32 array
    values: Any  # float32 array
    tokens: list[str] | None = None


class EncodedItem(msgspec.Struct, omit_defaults=True):
    id: ItemId
    dense: Any = None  # [dims] array
    sparse: SparseOut | None = None
    multivector: Any = None  # [tokens, dim] array


class Usage(msgspec.Struct):
    tokens: int


class Timings(msgspec.Struct):
    tokenize_ms: float
    queue_ms: float
    inference_ms: float
    total_ms: float


class EncodeResponse(msgspec.Struct):
    model: str
    items: list[EncodedItem]
    usage: Usage
    timings: Timings


# --- OpenAI-compatible /v1/embeddings ----------------------------------------------------------


class EmbeddingsRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    # Strings, or token ids (refused with a clear message): never arbitrarily nested.
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None

    def texts(self) -> list[str]:
        texts = [self.input] if isinstance(self.input, str) else self.input
        if not texts:
            raise InvalidRequest("`input` is empty: send a string or a non-empty list of strings")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"`input[{i}]` is {type(text).__name__}: only text input is supported, "
                    "send strings rather than token ids",
                    details={"path": f"$.input[{i}]"},
                )
        return texts


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingsUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage
    object: str = "list"


def openai_embedding(index: int, vector: np.ndarray, encoding_format: str) -> Embedding:
    """OpenAI's base64 format is the float32 little-endian bytes of the vector."""
    if encoding_format == "base64":
        raw = np.ascontiguousarray(vector, dtype="<f4").tobytes()
        return Embedding(index=index, embedding=base64.b64encode(raw).decode("ascii"))
    return Embedding(index=index, embedding=vector.astype(np.float32).tolist())


# --- errors -------------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct):
    code: str
    message: str
    details: dict[str, Any] = {}


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


# --- codecs -------------------------------------------------------------------------------------


def array_to_msgpack(array: np.ndarray) -> dict[str, Any]:
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": str(array.dtype.name), "shape": list(array.shape), "data": np.ascontiguousarray(little).tobytes()}


def array_from_msgpack(obj: dict[str, Any]) -> np.ndarray:
    dtype = np.dtype(obj["dtype"]).newbyteorder("<")
    return np.frombuffer(obj["data"], dtype=dtype).reshape(obj["shape"])


def _msgpack_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return array_to_msgpack(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _json_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_json_encoder = msgspec.json.Encoder(enc_hook=_json_hook)
_msgpack_encoder = msgspec.msgpack.Encoder(enc_hook=_msgpack_hook)


def encode(obj: Any, fmt: Format) -> bytes:
    if fmt is Format.MSGPACK:
        return _msgpack_encoder.encode(obj)
    return _json_encoder.encode(obj)


def decode(body: bytes, fmt: Format, type: type[Any]) -> Any:
    """Decode and validate a request body; every failure is an InvalidRequest naming the problem."""
    name = "msgpack" if fmt is Format.MSGPACK else "JSON"
    try:
        if fmt is Format.MSGPACK:
            return msgspec.msgpack.decode(body, type=type)
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        if "surrogate" in str(exc):  # JSON's \\uD800-\\uDFFF escapes that pair with nothing
            byte = _byte_of(str(exc))
            raise InvalidRequest(
                f"malformed JSON body: a \\u escape at byte {byte} is half of a UTF-16 surrogate pair with no "
                "other half, which is not text; send valid Unicode (escape a character outside the BMP as a pair, "
                "or send it as UTF-8)", details={"byte": byte}) from None
        raise InvalidRequest(f"malformed {name} body: {exc}") from None


def _byte_of(message: str) -> int | None:
    found = re.search(r"\(byte (\d+)\)", message)
    return int(found.group(1)) if found else None
