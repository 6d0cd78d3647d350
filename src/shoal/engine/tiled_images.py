"""Page images into tiles for Idefics3 vision-language models (SmolVLM, ColSmol); numpy and Pillow,
no torch.

    decode_image(bytes) ─▶ RGB ─▶ longest edge to `longest_edge` ─▶ each side up to a multiple of `tile`
        ─▶ tile x tile crops, row-major, then the whole image resized to one tile ─▶ patch rows
    image_prompt(rows, cols, image_seq_len) ─▶ the text that stands for the image in the prompt

`TiledImagePreprocessor` reproduces the PIL backend of transformers' `Idefics3ImageProcessor`
(`Idefics3ImageProcessorPil`) with image splitting on, pixel for pixel: every resize is a Pillow
resize of the uint8 image (each from the previous one's output, as the processor chains them), and
each tile is rescaled and normalised as CLIP's PIL processor does it (`images.ImagePreprocessor`,
whose numerics and patch-row layout are reused). An image whose resized sides are one tile is that
tile alone, with no global image and `rows = cols = 0`, as the processor returns it.

`TiledImageInputs` is the image `Preprocessor` (engine/backend.py) of such a model: an image is
one sequence, the model's prompt with its `<image>` expanded as `Idefics3Processor` expands it
(`<image>` repeated `image_seq_len` times per tile, each tile tagged with its place) and tokenized
whole, its tiles' patch rows in the `pixels` feature slot. What a load checks (`load_tiled_inputs`):
the folder's image processor is one this module follows, its tile is the vision tower's image
size, the prompt of an image with the most tiles fits the model's max_length, and the tokenizer
reads each `<image>` as the model's image token.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from ..errors import ModelLoadError
from .image_inputs import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from .images import ImagePreprocessor, decode_image, to_rgb
from .types import Encoded

if TYPE_CHECKING:
    from ..catalog import ModelCard
    from .tokenizer import TextTokenizer

IMAGE_TOKEN = "<image>"
MAX_IMAGE_SIDE = 4096  # transformers' MAX_IMAGE_SIZE: no side is longer after the first resize

# What Idefics3ImageProcessor uses for a key its config leaves out or sets to null (its class attributes).
_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "size": {"longest_edge": 4 * 364},
    "max_image_size": {"longest_edge": 364},
    "resample": Image.Resampling.LANCZOS,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "do_image_splitting": True,
}
_PROCESSOR_TYPES = ("Idefics3ImageProcessor", "Idefics3ImageProcessorFast", "Idefics3ImageProcessorPil")


@dataclass(frozen=True)
class TiledImagePreprocessor:
    """An Idefics3 image processor with image splitting: an image into `tile`-pixel tiles of
    `patch_size`-pixel patches (see the module's docstring)."""

    longest_edge: int  # the first resize: the longest side to this (size["longest_edge"])
    tile: int  # the tile side (max_image_size["longest_edge"]), the vision tower's image size
    patch_size: int
    resample: Image.Resampling
    rescale_factor: float | None  # None: no rescale
    image_mean: tuple[float, ...] | None  # None: no normalisation
    image_std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], patch_size: int) -> TiledImagePreprocessor:
        """From a preprocessor_config.json, or the `image_processor` of a processor_config.json, read
        as transformers reads it (a missing or null key: the class's default). A ValueError naming
        the key for what this module does not follow."""
        settings = {**_DEFAULTS, **{key: value for key, value in config.items() if value is not None}}
        named = settings.get("image_processor_type")
        if named is not None and named not in _PROCESSOR_TYPES:
            raise ValueError(f"image_processor_type {named!r} is not one of {list(_PROCESSOR_TYPES)}")
        if settings["do_image_splitting"] is not True:
            raise ValueError("do_image_splitting is not true: only tiled images are served")
        if settings["do_resize"] is not True:
            raise ValueError("do_resize is not true: an image's tiles would have no bound")
        longest_edge = _longest_edge("size", settings["size"])
        tile = _longest_edge("max_image_size", settings["max_image_size"])
        if patch_size < 1 or tile % patch_size:
            raise ValueError(f"max_image_size: {tile}-pixel tiles do not hold whole {patch_size}-pixel patches")
        try:
            resample = Image.Resampling(int(settings["resample"]))
        except (TypeError, ValueError):
            raise ValueError(f"resample {settings['resample']!r} is not a Pillow resampling filter") from None
        normalize = settings["do_normalize"]
        return cls(
            longest_edge=longest_edge,
            tile=tile,
            patch_size=patch_size,
            resample=resample,
            rescale_factor=_number("rescale_factor", settings["rescale_factor"]) if settings["do_rescale"] else None,
            image_mean=_per_channel("image_mean", settings["image_mean"]) if normalize else None,
            image_std=_per_channel("image_std", settings["image_std"]) if normalize else None,
        )

    @property
    def patches_per_tile(self) -> int:
        return (self.tile // self.patch_size) ** 2

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles, as the processor returns them, for an image of height x width
        pixels; (0, 0) when it is one tile."""
        height, width = _tiled_size(*_first_size(height, width, self.longest_edge), self.tile)
        rows, cols = height // self.tile, width // self.tile
        return (0, 0) if rows * cols == 1 else (rows, cols)

    def max_tiles(self) -> int:
        """The most tiles one image gives: a square image's grid and the global image (the first
        resize gives every image the same longest side, and a square the longest short side)."""
        rows, cols = self.grid(1, 1)
        return rows * cols + 1

    def tiles(self, image: Image.Image) -> tuple[np.ndarray, int, int]:
        """(patch rows `[n_tiles * patches_per_tile, 3 * p * p]` float32, rows, cols): the tiles
        row-major, then the global image; a lone tile and `rows = cols = 0` when the resized image
        is one tile. Each tile's rows are its patches row-major, each flattened (channel, row, col)."""
        image = to_rgb(image)
        height, width = _first_size(image.height, image.width, self.longest_edge)
        image = image.resize((width, height), resample=self.resample)
        height, width = _tiled_size(height, width, self.tile)
        image = image.resize((width, height), resample=self.resample)
        t = self.tile
        rows, cols = height // t, width // t
        if rows * cols == 1:
            frames, rows, cols = [image], 0, 0
        else:
            frames = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
            frames.append(image.resize((t, t), resample=self.resample))
        one_tile = self._one_tile()
        pixels = np.concatenate([one_tile.patch_rows(one_tile.pixel_values(frame)) for frame in frames])
        return pixels, rows, cols

    def _one_tile(self) -> ImagePreprocessor:
        # A tile-sized image through CLIP's steps: the centre crop to its own size keeps it whole.
        return ImagePreprocessor(
            shortest_edge=None,
            resize_to=None,
            resample=self.resample,
            crop_size=(self.tile, self.tile),
            rescale_factor=self.rescale_factor,
            image_mean=self.image_mean,
            image_std=self.image_std,
            patch_size=self.patch_size,
            extra_tokens=0,
        )


def _first_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """(height, width) of the first resize: the longest side to `longest_edge`, the other scaled,
    truncated and made even (at least 1); then neither over MAX_IMAGE_SIDE. The processor's float
    arithmetic, step for step."""
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect_ratio = width / height
    if width >= height and width > MAX_IMAGE_SIDE:
        width = MAX_IMAGE_SIDE
        height = int(width / aspect_ratio)
    elif height > width and height > MAX_IMAGE_SIDE:
        height = MAX_IMAGE_SIDE
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def _tiled_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) of the second resize: the longest side up to a multiple of `tile`, the other
    scaled by that side's new length, truncated, then up to a multiple of `tile`. Both sides come
    out at least one tile: the scaled side is never shorter than it was."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    return height, width


def image_prompt(rows: int, cols: int, image_seq_len: int) -> str:
    """The text `Idefics3Processor` puts in place of one `<image>` for an image of rows x cols tiles
    (0 x 0: a lone tile): each tile tagged with its place, a newline after each row of tiles, then
    the global image."""
    tokens = IMAGE_TOKEN * image_seq_len
    global_image = f"<fake_token_around_image><global-img>{tokens}<fake_token_around_image>"
    if rows == 0 and cols == 0:
        return global_image
    grid = "".join(
        "".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{global_image}"


@dataclass(frozen=True)
class TiledImageInputs:
    """Image file bytes -> the model's prompt around the image's tiles (`backend.Preprocessor`)."""

    tokenizer: TextTokenizer
    images: TiledImagePreprocessor
    prompt: str  # the text around an image, with one "<image>"
    image_seq_len: int  # <image> tokens per tile
    image_token_id: int
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    modality = "image"

    def prepare(self, values: Sequence[bytes], truncate: bool, *, first_index: int, what: str) -> list[Encoded]:
        """One sequence per image: the prompt's ids, special tokens added as the tokenizer adds them,
        and the tiles' patch rows; an InvalidRequest (or a 413) names `what[i]`. `truncate` does not
        apply: cutting the prompt would cut the image's tokens."""
        tiled = [
            self.images.tiles(
                decode_image(data, max_bytes=self.max_bytes, max_pixels=self.max_pixels, what=f"{what}[{index}]")
            )
            for index, data in enumerate(values, start=first_index)
        ]
        texts = [self.expanded_prompt(rows, cols) for _, rows, cols in tiled]
        encoded = self.tokenizer.encode(texts, False, first_index=first_index, what=what)
        out = []
        for (pixels, _, _), sequence in zip(tiled, encoded):
            self._check_image_tokens(sequence.ids, pixels.shape[0] // self.images.patches_per_tile)
            out.append(replace(sequence, features={"pixels": pixels}))
        return out

    def expanded_prompt(self, rows: int, cols: int) -> str:
        """The prompt of an image of rows x cols tiles."""
        return self.prompt.replace(IMAGE_TOKEN, image_prompt(rows, cols, self.image_seq_len), 1)

    def max_tokens(self) -> int:
        """The tokens of the prompt of an image with the most tiles; a ModelLoadError if the model's
        max_length cuts it, or if the tokenizer does not read its `<image>` as the image token."""
        rows, cols = self.images.grid(1, 1)
        text = self.expanded_prompt(rows, cols)
        (sequence,) = self.tokenizer.encode([text], True, first_index=None, what="image_prompt")
        if sequence.truncated:
            raise ModelLoadError(
                f"the prompt of a {rows}x{cols}-tile image is longer than the model's max_length of "
                f"{self.tokenizer.max_length} tokens"
            )
        self._check_image_tokens(sequence.ids, self.images.max_tiles())
        return len(sequence)

    def _check_image_tokens(self, ids: np.ndarray, num_tiles: int) -> None:
        found = int(np.count_nonzero(ids == self.image_token_id))
        if found != num_tiles * self.image_seq_len:
            raise ModelLoadError(
                f"the tokenizer reads {num_tiles} tiles' {num_tiles * self.image_seq_len} {IMAGE_TOKEN} as "
                f"{found} tokens of id {self.image_token_id}, the model's image token: it does not keep "
                f"{IMAGE_TOKEN} whole as that token",
                details={"image_token_id": self.image_token_id},
            )


def load_tiled_inputs(
    card: ModelCard,
    directory: Path,
    *,
    tokenizer: TextTokenizer,
    patch_size: int,
    tile_size: int,
    image_token_id: int,
    prompt: str,
    limits: tuple[int, int] | None = None,
) -> TiledImageInputs:
    """The page-image preprocessor of the model in `directory`: its image processor as transformers
    finds it (processor_config.json's `image_processor`, else preprocessor_config.json) and its
    `image_seq_len` (processor_config.json), checked against the vision tower's `tile_size` and the
    tokenizer (see the module's docstring); a ModelLoadError names what disagrees. `limits`: the
    bytes and pixels a client's file may have; None: MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS."""

    def fail(message: str) -> ModelLoadError:
        return ModelLoadError(f"model {card.id}: {message}", details={"model": card.id, "directory": str(directory)})

    processor = _read_json(directory / "processor_config.json", fail)
    source, config = "processor_config.json", processor.get("image_processor")
    if not isinstance(config, dict):
        source = "preprocessor_config.json"
        if not (directory / source).is_file():
            raise fail("has no image processor: neither processor_config.json's image_processor nor " + source)
        config = _read_json(directory / source, fail)
    try:
        images = TiledImagePreprocessor.from_config(config, patch_size)
    except ValueError as exc:
        raise fail(f"{source}: {exc}") from None
    if images.tile != tile_size:
        raise fail(f"{source} cuts {images.tile}-pixel tiles; its vision tower takes {tile_size}-pixel images")
    image_seq_len = processor.get("image_seq_len")
    if not isinstance(image_seq_len, int) or isinstance(image_seq_len, bool) or image_seq_len < 1:
        raise fail(f"processor_config.json's image_seq_len (the {IMAGE_TOKEN} tokens per tile) is {image_seq_len!r}")
    if prompt.count(IMAGE_TOKEN) != 1:
        raise fail(f"its image prompt {prompt!r} has {prompt.count(IMAGE_TOKEN)} {IMAGE_TOKEN}, not one")
    max_bytes, max_pixels = limits or (MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS)
    inputs = TiledImageInputs(tokenizer, images, prompt, image_seq_len, image_token_id, max_bytes, max_pixels)
    try:
        inputs.max_tokens()  # the largest image's prompt fits and keeps every <image> whole
    except ModelLoadError as exc:
        raise fail(exc.message) from None
    return inputs


def _read_json(path: Path, fail: Callable[[str], ModelLoadError]) -> dict[str, Any]:
    """The JSON object in `path`; {} when there is no such file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read {path.name}: {exc}") from None
    if not isinstance(value, dict):
        raise fail(f"{path.name} is not a JSON object")
    return value


def _longest_edge(key: str, value: object) -> int:
    if isinstance(value, Mapping) and isinstance(value.get("longest_edge"), int) and value["longest_edge"] >= 1:
        return int(value["longest_edge"])
    raise ValueError(f"{key} {value!r} has no positive longest_edge")


def _number(key: str, value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{key} {value!r} is not a number")


def _per_channel(key: str, value: object) -> tuple[float, ...]:
    if isinstance(value, (list, tuple)) and len(value) == 3:
        return tuple(_number(key, v) for v in value)
    try:
        return (_number(key, value),) * 3
    except ValueError:
        raise ValueError(f"{key} {value!r} is not one number or three") from None


__all__ = ["TiledImageInputs", "TiledImagePreprocessor", "image_prompt", "load_tiled_inputs"]
