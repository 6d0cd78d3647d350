"""The image `Preprocessor` (engine/backend.py) of a model that reads images: a client's file bytes
decoded and checked (engine/images.py `decode_image`), then cut into the vision tower's patch rows
(`ImagePreprocessor`), one sequence per image, `tokens_per_image` long. Runs on the tokenizer
pool's threads (Pillow releases the GIL while it decodes and resizes).

What a load checks: the folder has the model's preprocessor_config.json (an OpenCLIP folder: its
open_clip_config.json's `preprocess_cfg`, as open_clip preprocesses), the image size it makes
holds the tower's patch grid, and the card's `image_tokens` (what admission and the gateway count
an image as) is what one image really costs on this model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..catalog import ModelCard
from ..errors import ModelLoadError
from .images import ImagePreprocessor, decode_image
from .open_clip_images import preprocessor_config
from .types import Encoded

# A client's image file: at most this many bytes, and this many pixels as its header declares
# (12 MP phones, 24-36 MP cameras and 8K frames fit; about 108 MB of RGB at the most).
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 36_000_000


@dataclass(frozen=True)
class ImageInputs:
    """Image file bytes -> checked, preprocessed sequences (`backend.Preprocessor`)."""

    images: ImagePreprocessor
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    modality = "image"

    def prepare(self, values: Sequence[bytes], truncate: bool, *, first_index: int, what: str) -> list[Encoded]:
        """One sequence per image; an InvalidRequest (or a 413) names `what[i]`. `truncate` does
        not apply: an image is resized to the tower's resolution."""
        return [
            self.images.prepare(
                decode_image(data, max_bytes=self.max_bytes, max_pixels=self.max_pixels, what=f"{what}[{index}]")
            )
            for index, data in enumerate(values, start=first_index)
        ]


def load_image_inputs(
    card: ModelCard,
    directory: Path,
    *,
    patch_size: int,
    num_patches: int,
    tokens_per_image: int,
    limits: tuple[int, int] | None = None,
) -> ImageInputs:
    """The image preprocessor of the model in `directory`, checked against the tower and the card
    (see the module's docstring); a ModelLoadError names what disagrees. `limits`: the bytes and
    pixels a client's file may have (the engine's settings); None: MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS."""

    def fail(message: str) -> ModelLoadError:
        return ModelLoadError(f"model {card.id}: {message}", details={"model": card.id, "directory": str(directory)})

    # transformers' preprocessor_config.json, else an OpenCLIP folder's open_clip_config.json
    path = directory / "preprocessor_config.json"
    if not path.is_file() and (directory / "open_clip_config.json").is_file():
        path = directory / "open_clip_config.json"
    try:
        config = json.loads(path.read_text())
        if path.name == "open_clip_config.json":
            config = preprocessor_config(config)
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read its image preprocessing from {path.name}: {exc}") from None
    images = ImagePreprocessor.from_config(config, patch_size, tokens_per_image - num_patches)
    if images.num_patches != num_patches:
        height, width = images.image_size
        raise fail(
            f"{path.name} makes {height}x{width} images, {images.num_patches} patches of {patch_size} pixels; "
            f"the vision tower takes {num_patches}"
        )
    if card.image_tokens != tokens_per_image:
        raise fail(f"the card's image_tokens is {card.image_tokens}; an image is {tokens_per_image} tokens on it")
    max_bytes, max_pixels = limits or (MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS)
    return ImageInputs(images, max_bytes, max_pixels)
