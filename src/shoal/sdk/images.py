"""Images the client sends: `Image` wraps one image and reads it into the file's bytes when its
request is built; `png_of` writes a numpy array as a PNG file.

An image is given as a file path (`str` or `os.PathLike`: the file is read as it is, any format
the server decodes), the file's bytes, a binary file object (`io.BytesIO`...), a PIL image (saved
as PNG in memory, with the PIL the caller already imported: the client never imports it), or a
`[H, W]`, `[H, W, 3]` or `[H, W, 4]` uint8 numpy array (written as PNG here, with zlib). The bytes
go as they are in msgpack and as base64 in JSON (msgspec encodes `bytes` so). A URL is refused:
the server fetches none, and neither does the client.
"""

from __future__ import annotations

import io
import os
import re
import struct
import sys
import zlib
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeAlias

import numpy as np

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

# What `Image` (and `encode(images=...)`) takes.
ImageSource: TypeAlias = (
    "str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes] | np.ndarray | PILImage | Image"
)

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:(//|image/)")  # http://..., data:image/...: not a path
_PNG_COLOR_TYPES = {1: 0, 3: 2, 4: 6}  # channels -> PNG color type: gray, RGB, RGBA
_PIL_PNG_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA"})  # saved as PNG as they are


class Image:
    """One image input: `Image("cat.jpg")`, `Image(Path(...))`, `Image(file_bytes)`,
    `Image(io.BytesIO(...))`, `Image(pil_image)` or `Image(uint8_array)`.

    `encode(images=[...])` takes these sources bare; `score` takes an image query or document
    wrapped in `Image`, since a bare `str` there is a text. A wrong type is a TypeError here; a
    path is read when its request is built, and a missing file raised before the call sends any.
    """

    __slots__ = ("source",)
    source: ImageSource  # never an Image: one given is unwrapped

    def __init__(self, source: ImageSource) -> None:
        if isinstance(source, Image):
            source = source.source
        elif isinstance(source, str) and _URL.match(source):
            raise ValueError(
                f"Image takes a file path, bytes, a PIL image or an array, not a URL ({source[:40]}...): "
                "neither the client nor the server fetches URLs; pass the file's bytes"
            )
        elif not _is_source(source):
            raise TypeError(
                f"an image is a file path, the file's bytes, a binary file object, a PIL image or a uint8 "
                f"numpy array, not {type(source).__name__}"
            )
        self.source = source

    def read(self) -> bytes:
        """The image file's bytes: a path read, an array or a PIL image written as PNG."""
        source = self.source
        if isinstance(source, (bytes, bytearray, memoryview)):
            return bytes(source)
        if isinstance(source, (str, os.PathLike)):
            return Path(source).read_bytes()
        if isinstance(source, np.ndarray):
            return png_of(source)
        if isinstance(source, io.BytesIO):
            return source.getvalue()  # the whole buffer, wherever its position is
        if hasattr(source, "read"):
            data = source.read()
            if not isinstance(data, bytes):
                raise TypeError(f"an image file object must be opened in binary mode: its read() gave {type(data)}")
            return data
        return _pil_png(source)

    def num_bytes(self) -> int:
        """The bytes this image is about to send, without reading it (a request is cut by them):
        the file's size, the bytes' length, an array's or a PIL image's raw pixels (at most what
        its PNG takes); 0 for a file object that is not a BytesIO."""
        source = self.source
        if isinstance(source, (bytes, bytearray)):
            return len(source)
        if isinstance(source, memoryview):
            return source.nbytes
        if isinstance(source, (str, os.PathLike)):
            return os.stat(source).st_size  # a missing file is raised here, before anything is sent
        if isinstance(source, np.ndarray):
            return source.nbytes
        if isinstance(source, io.BytesIO):
            return source.getbuffer().nbytes
        if hasattr(source, "read"):
            return 0
        width, height = source.size
        return width * height * len(source.getbands())

    def __repr__(self) -> str:
        source = self.source
        if isinstance(source, (bytes, bytearray, memoryview)):
            return f"Image(<{len(source)} bytes>)"
        if isinstance(source, np.ndarray):
            return f"Image(<array {source.shape} {source.dtype}>)"
        return f"Image({source!r})"


def image_of(source: ImageSource) -> Image:
    return source if isinstance(source, Image) else Image(source)


def png_of(pixels: np.ndarray) -> bytes:
    """A PNG file of a `[H, W]` (gray), `[H, W, 3]` (RGB) or `[H, W, 4]` (RGBA) uint8 array."""
    if pixels.dtype != np.uint8:
        raise TypeError(
            f"an image array must be uint8, not {pixels.dtype}: scale it to 0..255 and .astype(np.uint8) first"
        )
    channels = 1 if pixels.ndim == 2 else pixels.shape[-1] if pixels.ndim == 3 else 0
    if channels not in _PNG_COLOR_TYPES or 0 in pixels.shape:
        raise ValueError(f"an image array is [H, W], [H, W, 3] or [H, W, 4] with H, W > 0, not {list(pixels.shape)}")
    height, width = pixels.shape[:2]
    rows = np.ascontiguousarray(pixels).reshape(height, width * channels)
    scanlines = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1)  # filter type 0 a row
    header = struct.pack(">IIBBBBB", width, height, 8, _PNG_COLOR_TYPES[channels], 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(scanlines.tobytes(), 6))
        + _png_chunk(b"IEND", b"")
    )


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _is_pil(value: object) -> bool:
    pil = sys.modules.get("PIL.Image")  # not imported: the value cannot be one of its images
    return pil is not None and isinstance(value, pil.Image)


def _is_source(value: object) -> bool:
    return (
        isinstance(value, (str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, io.BytesIO))
        or (hasattr(value, "read") and not isinstance(value, io.TextIOBase))
        or _is_pil(value)
    )


def _pil_png(image: PILImage) -> bytes:
    if image.mode not in _PIL_PNG_MODES:  # CMYK, YCbCr, 32-bit and float: PNG has no such mode
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
