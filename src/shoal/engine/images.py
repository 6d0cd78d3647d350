"""Images into patch rows for CLIP and SigLIP vision towers; numpy and Pillow, no torch.

    decode_image(bytes) ─▶ RGB PIL image ─▶ ImagePreprocessor.pixel_values ─▶ [C, H, W] float32
                                        └─▶ ImagePreprocessor.prepare ─▶ Encoded(ids, features={"pixels": rows})

Decoding is the server's defence against what clients send: the bytes are capped, the format is
sniffed from its magic and only common still formats are opened (PNG, JPEG, WebP, GIF and TIFF
at their first frame, BMP), and the pixel count the header declares is checked before a pixel is
decoded. The image is then turned upright by its EXIF orientation, as transformers'
`load_image` does, and made RGB as transformers' image processors do: transparency is
composited onto white. One deliberate difference: 16-bit grayscale keeps its high byte, as Pillow
keeps it for 16-bit colour, where `Image.convert("RGB")` would clip every value over 255 to white.

`ImagePreprocessor` reproduces the PIL backend of transformers' `CLIPImageProcessor` and
`SiglipImageProcessor` (what `use_fast=False` / `backend="pil"` select) pixel for pixel: a Pillow
resize of the uint8 image (CLIP: the shortest edge to `size`, the long edge truncated; SigLIP: to
height x width), a uint8 centre crop (offset rounded down, zero-padded where the crop is larger),
a rescale in float64 rounded to float32, then `(x - mean) / std` in float32.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import InvalidRequest, ModelLoadError, PayloadTooLarge
from .types import Encoded

# (offset, magic, Pillow format): the formats served, sniffed before Pillow sees the bytes and
# handed to `Image.open(formats=...)`, so no other plugin ever parses client data (EPS would run
# Ghostscript; ICO, PSD, TGA... are not what clients send).
_SIGNATURES = (
    (0, b"\x89PNG\r\n\x1a\n", "PNG"),
    (0, b"\xff\xd8\xff", "JPEG"),  # Pillow opens a camera's multi-picture JPEG as MPO: its first picture
    (8, b"WEBP", "WEBP"),  # after b"RIFF" and the chunk length
    (0, b"GIF87a", "GIF"),
    (0, b"GIF89a", "GIF"),
    (0, b"BM", "BMP"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
    (0, b"II+\x00", "TIFF"),  # BigTIFF
    (0, b"MM\x00+", "TIFF"),
)
SUPPORTED_FORMATS = "PNG, JPEG, WebP, GIF, BMP or TIFF"

_SIXTEEN_BIT_GRAY = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


def decode_image(data: bytes, *, max_bytes: int, max_pixels: int, what: str) -> Image.Image:
    """An image file's bytes as an upright RGB image (the first frame of an animation).

    Refuses, naming the item `what` and saying what to fix: more than `max_bytes` bytes or a
    header declaring more than `max_pixels` pixels (PayloadTooLarge, 413; no pixel is decoded),
    no data, a format not served, and data Pillow cannot decode: corrupt, truncated or declaring
    a zero size (InvalidRequest, 400).
    """
    if not data:
        raise InvalidRequest(
            f"{what}: the image is empty (0 bytes); send the image file's bytes", details={"item": what}
        )
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{what}: the image file is {len(data)} bytes, over the limit of {max_bytes}; "
            "send a smaller file (downscale it, or re-encode it as JPEG)",
            details={"item": what, "num_bytes": len(data), "max_bytes": max_bytes},
        )
    image_format = next(
        (fmt for offset, magic, fmt in _SIGNATURES if data[offset : offset + len(magic)] == magic), None
    )
    if image_format is None:
        raise InvalidRequest(
            f"{what}: not an image in a supported format ({SUPPORTED_FORMATS}); convert it to PNG or JPEG",
            details={"item": what},
        )
    details: dict[str, object] = {"item": what, "format": image_format}
    try:
        # Lazy: reads the header only. Pillow's own bomb check (its process-wide MAX_IMAGE_PIXELS,
        # which an application may have lifted) can refuse first; ours below does not rely on it.
        image = Image.open(io.BytesIO(data), formats=(image_format,))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # the warning: under `-W error`
        raise _too_many_pixels(what, None, max_pixels, details) from None
    except Exception as exc:  # Pillow raises many types on bad headers (SyntaxError, struct.error, ...)
        raise _undecodable(what, image_format, exc, details) from None
    with image:
        width, height = image.size
        if width * height > max_pixels:
            raise _too_many_pixels(what, (width, height), max_pixels, details)
        if width == 0 or height == 0:
            raise InvalidRequest(f"{what}: the image is {width}x{height}: it has no pixels", details=details)
        try:
            image.load()
            upright = ImageOps.exif_transpose(image)
        except Exception as exc:  # bad pixel data or EXIF: OSError ("truncated"), zlib's error, ValueError, ...
            raise _undecodable(what, image_format, exc, details) from None
    try:
        return to_rgb(upright)
    except Exception as exc:  # a mode Pillow cannot convert (LAB, ...); its message says which
        raise InvalidRequest(
            f"{what}: the {upright.mode} image cannot be converted to RGB ({exc}); save it as 8-bit RGB",
            details={**details, "mode": upright.mode},
        ) from None


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` as RGB the way transformers' processors convert it (`convert_to_rgb`): anything
    with an alpha band or a transparent colour is composited onto white, the rest converted by
    Pillow; 16-bit grayscale first keeps its high byte (see the module docstring)."""
    if image.mode == "RGB":
        return image
    if image.mode in _SIXTEEN_BIT_GRAY:
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _too_many_pixels(
    what: str, size: tuple[int, int] | None, max_pixels: int, details: dict[str, object]
) -> PayloadTooLarge:
    declared = "more pixels than" if size is None else f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels, over"
    extra = {} if size is None else {"width": size[0], "height": size[1]}
    return PayloadTooLarge(
        f"{what}: the image declares {declared} the limit of {max_pixels}; downscale it before sending",
        details={**details, **extra, "max_pixels": max_pixels},
    )


def _undecodable(what: str, image_format: str, exc: Exception, details: dict[str, object]) -> InvalidRequest:
    reason = (
        f"not a valid {image_format} file"
        if isinstance(exc, UnidentifiedImageError)
        else str(exc) or type(exc).__name__
    )
    return InvalidRequest(
        f"{what}: the {image_format} data cannot be decoded ({reason}): it is corrupt, truncated or declares "
        "a zero size; send the complete image file",
        details=details,
    )


# --- preprocessing -----------------------------------------------------------------------------------

_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# What each processor class uses for a key its preprocessor_config.json leaves out (the class
# attributes of transformers' CLIPImageProcessor and SiglipImageProcessor).
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": {
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True,
        "resample": Image.Resampling.BICUBIC,
        "image_mean": _OPENAI_CLIP_MEAN,
        "image_std": _OPENAI_CLIP_STD,
    },
    "SiglipImageProcessor": {
        "size": {"height": 224, "width": 224},
        "do_center_crop": False,
        "resample": Image.Resampling.BICUBIC,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
    },
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
}


@dataclass(frozen=True)
class ImagePreprocessor:
    """A vision tower's image preprocessing, and its patch grid.

    One image is `num_tokens` tokens to the scheduler: `num_patches` rows of pixels plus
    `extra_tokens` placeholders for what the model adds (CLIP's class token; none for SigLIP).
    """

    shortest_edge: int | None  # resize the shorter side to this, keeping the aspect (CLIP)
    resize_to: tuple[int, int] | None  # or resize to (height, width) (SigLIP); neither: no resize
    resample: Image.Resampling
    crop_size: tuple[int, int] | None  # (height, width) centre crop; None: none
    rescale_factor: float | None  # None: no rescale
    image_mean: tuple[float, ...] | None  # None: no normalisation
    image_std: tuple[float, ...] | None
    patch_size: int
    extra_tokens: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any], patch_size: int, extra_tokens: int) -> ImagePreprocessor:
        """From a model's preprocessor_config.json, read as transformers reads it for the class it
        names (`image_processor_type`, or an older `feature_extractor_type`): an int `size` is the
        shortest edge, an int `crop_size` a square, a missing or null key the class's default.
        A ModelLoadError if the file asks for what these processors do not do."""
        named = str(config.get("image_processor_type") or config.get("feature_extractor_type") or "")
        kind = named.replace("FeatureExtractor", "ImageProcessor").removesuffix("Fast").removesuffix("Pil")
        if kind not in _CLASS_DEFAULTS:
            raise _config_error(f"image_processor_type {named!r} is not one of {sorted(_CLASS_DEFAULTS)}")
        settings = {**_COMMON_DEFAULTS, **_CLASS_DEFAULTS[kind]}
        settings.update({key: value for key, value in config.items() if value is not None})
        try:
            made = cls._from_settings(settings, patch_size, extra_tokens)
        except (KeyError, TypeError, ValueError) as exc:  # a value of the wrong type or range
            raise _config_error(f"cannot read it: {exc!r}") from None
        height, width = made.image_size
        if min(height, width, made.shortest_edge or 1) < 1 or not 0 < patch_size <= min(height, width):
            raise _config_error(f"{height}x{width} images do not hold {patch_size}-pixel patches")
        return made

    @classmethod
    def _from_settings(cls, settings: Mapping[str, Any], patch_size: int, extra_tokens: int) -> ImagePreprocessor:
        shortest_edge = resize_to = crop_size = None
        if settings["do_resize"]:
            size = settings["size"]
            if isinstance(size, int):
                shortest_edge = size
            elif isinstance(size, Mapping) and set(size) == {"shortest_edge"}:
                shortest_edge = int(size["shortest_edge"])
            else:
                resize_to = _height_width("size", size)
        if settings["do_center_crop"]:
            crop = settings["crop_size"]
            crop_size = (crop, crop) if isinstance(crop, int) else _height_width("crop_size", crop)
        if crop_size is None and resize_to is None:
            raise _config_error("the image size it makes is not fixed (no height x width resize and no centre crop)")
        mean = std = None
        if settings["do_normalize"]:
            mean, std = (
                _per_channel("image_mean", settings["image_mean"]),
                _per_channel("image_std", settings["image_std"]),
            )
        return cls(
            shortest_edge=shortest_edge,
            resize_to=resize_to,
            resample=Image.Resampling(int(settings["resample"])),
            crop_size=crop_size,
            rescale_factor=float(settings["rescale_factor"]) if settings["do_rescale"] else None,
            image_mean=mean,
            image_std=std,
            patch_size=patch_size,
            extra_tokens=extra_tokens,
        )

    @property
    def image_size(self) -> tuple[int, int]:
        """(height, width) of `pixel_values`."""
        size = self.crop_size or self.resize_to
        assert size is not None  # from_config refuses a config without either
        return size

    @property
    def grid(self) -> tuple[int, int]:
        """Patches down and across. Pixels past the last whole patch are dropped, as a stride-p
        convolution drops them (SigLIP so400m: 384 pixels, 27 patches of 14)."""
        height, width = self.image_size
        return height // self.patch_size, width // self.patch_size

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def num_tokens(self) -> int:
        """What one image costs in every token budget: its patches and the model's extra tokens."""
        return self.num_patches + self.extra_tokens

    def pixel_values(self, image: Image.Image) -> np.ndarray:
        """[C, H, W] float32: the processor's `pixel_values[0]` for `image`."""
        image = to_rgb(image)
        if self.shortest_edge is not None:
            image = image.resize(_shortest_edge_size(image.size, self.shortest_edge), resample=self.resample)
        elif self.resize_to is not None:
            height, width = self.resize_to
            image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image)  # [H, W, 3] uint8
        if self.crop_size is not None:
            pixels = _center_crop(pixels, *self.crop_size)
        chw = pixels.transpose(2, 0, 1)
        # The processor's order and precision: rescale in float64, round to float32, normalise in float32.
        if self.rescale_factor is not None:
            values = (chw.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            values = chw.astype(np.float32)
        if self.image_mean is not None and self.image_std is not None:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
            values = (values - mean) / std
        return np.ascontiguousarray(values)

    def patch_rows(self, pixel_values: np.ndarray) -> np.ndarray:
        """[C, H, W] -> [num_patches, C*p*p] float32: patches row-major over the grid, each
        flattened (channel, row, col), the order of a Conv2d patch embedding's weight."""
        channels = pixel_values.shape[0]
        p = self.patch_size
        rows, cols = self.grid
        whole = pixel_values[:, : rows * p, : cols * p]
        patches = whole.reshape(channels, rows, p, cols, p).transpose(1, 3, 0, 2, 4)  # [gh, gw, C, p, p]
        return np.ascontiguousarray(patches.reshape(rows * cols, channels * p * p), dtype=np.float32)

    def prepare(self, image: Image.Image) -> Encoded:
        """One image as a sequence: `num_tokens` placeholder ids (zeros) and its patch rows in the
        `pixels` feature slot."""
        rows = self.patch_rows(self.pixel_values(image))
        return Encoded(ids=np.zeros(self.num_tokens, dtype=np.int64), features={"pixels": rows})


def _shortest_edge_size(size: tuple[int, int], shortest_edge: int) -> tuple[int, int]:
    """(width, height) with the shorter side `shortest_edge` and the longer one scaled and
    truncated, as transformers' `get_resize_output_image_size` (no `max_size`) computes it."""
    width, height = size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (shortest_edge, new_long) if width <= height else (new_long, shortest_edge)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] -> [height, width, C] around the centre, its offset rounded down; zeros where the
    crop reaches past the image (transformers' `center_crop` pads so)."""
    top, left = (pixels.shape[0] - height) // 2, (pixels.shape[1] - width) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + height, left : left + width]
    out = np.zeros((height, width, pixels.shape[2]), dtype=pixels.dtype)
    inside = pixels[max(top, 0) : top + height, max(left, 0) : left + width]
    out_top, out_left = max(-top, 0), max(-left, 0)
    out[out_top : out_top + inside.shape[0], out_left : out_left + inside.shape[1]] = inside
    return out


def _height_width(key: str, value: object) -> tuple[int, int]:
    if isinstance(value, Mapping) and set(value) == {"height", "width"}:
        return int(value["height"]), int(value["width"])
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise _config_error(f"`{key}` {value!r} is not an int, {{'shortest_edge'}} or {{'height', 'width'}}")


def _per_channel(key: str, value: object) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    if isinstance(value, (list, tuple)) and len(value) == 3:
        return tuple(float(v) for v in value)
    raise _config_error(f"`{key}` {value!r} is not one number or three")


def _config_error(problem: str) -> ModelLoadError:
    return ModelLoadError(f"preprocessor_config.json: {problem}", details={"file": "preprocessor_config.json"})


__all__ = ["SUPPORTED_FORMATS", "ImagePreprocessor", "decode_image", "to_rgb"]
