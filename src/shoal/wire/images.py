"""Images on the wire: the field type an image travels in, and its reading into the file's bytes.

An image is the file's bytes: in JSON a base64 string or a `data:image/...;base64,...` URL, in
msgpack either of those or the raw bytes (bin). The server fetches no URL. This module only turns
the client's encoding into bytes (`image_bytes`), and an item's `text` or `image` into a call's
input (`input_of`); the engine decodes and checks the image itself. Every refusal is an
InvalidRequest naming the field (`items[3].image`, `query.image`) and saying what to send.
"""

from __future__ import annotations

import base64
import re
from typing import Annotated, Any

import msgspec
from msgspec import UNSET

from ..calls import Input, Item
from ..errors import InvalidRequest

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
