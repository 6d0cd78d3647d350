"""Body formats and codecs shared by every route family: JSON or msgpack, arrays, error bodies.

Requests decode into msgspec Structs, so decoding validates types and rejects unknown fields with a
message that names the path (`$.options.foo`). Arrays in responses are numpy arrays until encoding:
msgpack carries them as `{dtype, shape, data}` with raw little-endian bytes; JSON as nested lists.
"""

from __future__ import annotations

import enum
import re
from typing import Any, TypedDict, TypeVar

import msgspec
import numpy as np

from ..errors import InvalidRequest, UnsupportedMediaType

JSON = "application/json"
MSGPACK = "application/msgpack"
_MSGPACK_ALIASES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


# A JSON object whose fields no wire type fixes (TEI's `/info`, an error's details).
JSONObject = dict[str, object]
T = TypeVar("T")


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


# --- errors -------------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct):
    code: str
    message: str
    details: dict[str, Any] = {}  # any JSON (Any, not object: its schema must stay an open object)


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


# --- arrays -------------------------------------------------------------------------------------


class MsgpackArray(TypedDict):
    """An array in msgpack: its dtype's name, its shape, its raw little-endian bytes."""

    dtype: str
    shape: list[int]
    data: bytes


def array_to_msgpack(array: np.ndarray) -> MsgpackArray:
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": str(array.dtype.name), "shape": list(array.shape), "data": np.ascontiguousarray(little).tobytes()}


def array_from_msgpack(obj: MsgpackArray) -> np.ndarray:
    dtype = np.dtype(obj["dtype"]).newbyteorder("<")
    return np.frombuffer(obj["data"], dtype=dtype).reshape(obj["shape"])


def _msgpack_hook(obj: object) -> MsgpackArray:
    if isinstance(obj, np.ndarray):
        return array_to_msgpack(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _json_hook(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


# --- encode / decode ----------------------------------------------------------------------------


_json_encoder = msgspec.json.Encoder(enc_hook=_json_hook)
_msgpack_encoder = msgspec.msgpack.Encoder(enc_hook=_msgpack_hook)


def encode(obj: object, fmt: Format) -> bytes:
    if fmt is Format.MSGPACK:
        return _msgpack_encoder.encode(obj)
    return _json_encoder.encode(obj)


def decode(body: bytes, fmt: Format, type: type[T]) -> T:
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
                "or send it as UTF-8)",
                details={"byte": byte},
            ) from None
        raise InvalidRequest(f"malformed {name} body: {exc}") from None


def _byte_of(message: str) -> int | None:
    found = re.search(r"\(byte (\d+)\)", message)
    return int(found.group(1)) if found else None
