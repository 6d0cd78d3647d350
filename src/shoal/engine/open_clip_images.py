"""open_clip's image preprocessing, from an open_clip_config.json, as shoal's `ImagePreprocessor`.

open_clip's inference transform for a ViT CLIP (`open_clip.image_transform`, the default
`resize_mode: shortest`) is transformers' CLIPImageProcessor in torchvision: the shorter edge
resized to the tower's image size by Pillow (bicubic, or `interpolation: bilinear`; the longer
edge truncated), a square centre crop, ToTensor, then `(x - mean) / std` with `preprocess_cfg`'s
mean and std (OpenAI's by default). `resize_mode: squash` resizes to the square directly;
`longest` (a resize inside the square and a padding) is not implemented.

One difference remains: where a crop leaves an odd number of pixels to split, torchvision rounds
the crop's offset half to even and transformers (so `ImagePreprocessor`) rounds it down. When the
resized longer edge exceeds the crop by 3 modulo 4 pixels (e.g. 227 for 224), open_clip's crop
starts one pixel further along it than shoal's. Otherwise the pixels are equal up to float32
rounding (ToTensor divides in float32, `ImagePreprocessor` rescales in float64).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .images import ImagePreprocessor

# open_clip's OPENAI_DATASET_MEAN / STD: PreprocessCfg's defaults.
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)
_PIL_RESAMPLE = {"bicubic": 3, "bilinear": 2}  # PIL.Image.Resampling's values


def preprocessor_config(open_clip_config: Mapping[str, Any]) -> dict[str, Any]:
    """The preprocessor_config.json (CLIPImageProcessor's keys) that preprocesses images as
    open_clip does for `open_clip_config` (see the module's docstring). A ValueError names a
    setting it cannot express."""
    vision = (open_clip_config.get("model_cfg") or {}).get("vision_cfg") or {}
    preprocess = open_clip_config.get("preprocess_cfg") or {}
    size = vision.get("image_size", 224)  # open_clip takes the tower's, whatever preprocess_cfg says
    height, width = (size, size) if isinstance(size, int) else size
    interpolation = preprocess.get("interpolation") or "bicubic"
    mode = preprocess.get("resize_mode") or "shortest"
    if mode not in ("shortest", "squash") or (mode == "shortest" and height != width):
        raise ValueError(f"open_clip resize_mode {mode!r} to {height}x{width} is not implemented")
    config: dict[str, Any] = {
        "image_processor_type": "CLIPImageProcessor",
        "resample": _PIL_RESAMPLE.get(interpolation, 3),  # open_clip: bilinear, else bicubic
        "image_mean": list(preprocess.get("mean") or _MEAN),
        "image_std": list(preprocess.get("std") or _STD),
    }
    if mode == "shortest":
        return {**config, "size": {"shortest_edge": height}, "crop_size": {"height": height, "width": width}}
    return {**config, "size": {"height": height, "width": width}, "do_center_crop": False}


def from_open_clip(open_clip_config: Mapping[str, Any], patch_size: int, extra_tokens: int) -> ImagePreprocessor:
    """`ImagePreprocessor.from_config` of `preprocessor_config(open_clip_config)`."""
    return ImagePreprocessor.from_config(preprocessor_config(open_clip_config), patch_size, extra_tokens)
