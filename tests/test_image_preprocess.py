"""shoal's image decoding and CLIP / SigLIP preprocessing against transformers' PIL-backend image
processors (`CLIPImageProcessorPil`, `SiglipImageProcessorPil`: what `use_fast=False` selects), on
the photos scikit-image ships, sent as PNG and JPEG bytes the way a client sends them; the patch
rows against a Conv2d patch embedding; and each refusal of a bad upload."""

from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from skimage import data as photos
from transformers.image_utils import load_image

from shoal.engine.images import ImagePreprocessor, decode_image
from shoal.engine.types import Batch
from shoal.errors import InvalidRequest, ModelLoadError, PayloadTooLarge

LIMITS = dict(max_bytes=8 << 20, max_pixels=4_000_000)
WHAT = "items[3]"

# preprocessor_config.json as the Hub ships them: openai's old int form, the dict form, SigLIP's.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
CLIP_B32 = {  # openai/clip-vit-base-patch32
    "crop_size": 224,
    "do_center_crop": True,
    "do_normalize": True,
    "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor",
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "resample": 3,
    "size": 224,
}
CLIP_L14_336 = {**CLIP_B32, "crop_size": 336, "size": 336}  # openai/clip-vit-large-patch14-336
CLIP_DICT_336_CROP_224 = {
    "image_processor_type": "CLIPImageProcessor",
    "do_convert_rgb": True,
    "do_rescale": True,
    "rescale_factor": 0.00392156862745098,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "resample": 3,
    "size": {"shortest_edge": 336},
    "crop_size": {"height": 224, "width": 224},
}
CLIP_CROP_LARGER = {
    **CLIP_DICT_336_CROP_224,
    "size": {"shortest_edge": 224},
    "crop_size": {"height": 336, "width": 336},
}
SIGLIP_224 = {  # google/siglip-base-patch16-224
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "SiglipImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "SiglipProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 224, "width": 224},
}
SIGLIP_384 = {**SIGLIP_224, "size": {"height": 384, "width": 384}}  # google/siglip-so400m-patch14-384

# name: (config, reference class, patch size, extra tokens)
CARDS = {
    "clip-b32": (CLIP_B32, transformers.CLIPImageProcessorPil, 32, 1),
    "clip-l14-336": (CLIP_L14_336, transformers.CLIPImageProcessorPil, 14, 1),
    "clip-resize-336-crop-224": (CLIP_DICT_336_CROP_224, transformers.CLIPImageProcessorPil, 14, 1),
    "clip-crop-past-the-image": (CLIP_CROP_LARGER, transformers.CLIPImageProcessorPil, 14, 1),
    "siglip-224": (SIGLIP_224, transformers.SiglipImageProcessorPil, 16, 0),
    "siglip-384-patch14": (SIGLIP_384, transformers.SiglipImageProcessorPil, 14, 0),
}
PHOTOS = ("astronaut", "coffee", "chelsea")  # 512x512, 600x400, 451x300


def encode(image: Image.Image, image_format: str, **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **save)
    return buffer.getvalue()


@functools.cache
def photo_pixels(name: str) -> np.ndarray:
    return getattr(photos, name)()


def photo(name: str) -> Image.Image:
    return Image.fromarray(photo_pixels(name))


@functools.cache
def photo_file(name: str, image_format: str) -> bytes:
    return encode(photo(name), image_format)


def reference(card: str, image: Image.Image) -> np.ndarray:
    config, processor_class, _, _ = CARDS[card]
    return processor_class.from_dict(config)(images=image, return_tensors="np")["pixel_values"][0]


def preprocessor(card: str) -> ImagePreprocessor:
    config, _, patch_size, extra_tokens = CARDS[card]
    return ImagePreprocessor.from_config(config, patch_size, extra_tokens)


def assert_same_pixels(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs), f"max |diff| {np.abs(ours - theirs).max()}"


# --- parity ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("image_format", ["PNG", "JPEG"])
@pytest.mark.parametrize("name", PHOTOS)
@pytest.mark.parametrize("card", sorted(CARDS))
def test_pixel_values_equal_the_transformers_processor_exactly(card: str, name: str, image_format: str) -> None:
    sent = photo_file(name, image_format)
    ours = preprocessor(card).pixel_values(decode_image(sent, **LIMITS, what=WHAT))
    assert_same_pixels(ours, reference(card, Image.open(io.BytesIO(sent))))


@pytest.mark.parametrize("card", ["clip-b32", "siglip-224"])
def test_missing_config_keys_take_the_processor_class_defaults(card: str) -> None:
    config, processor_class, patch_size, extra_tokens = CARDS[card]
    bare = {"image_processor_type": processor_class.__name__.removesuffix("Pil")}
    image = photo("chelsea")
    ours = ImagePreprocessor.from_config(bare, patch_size, extra_tokens).pixel_values(image)
    assert_same_pixels(ours, processor_class()(images=image, return_tensors="np")["pixel_values"][0])


@pytest.mark.parametrize(
    ("card", "num_tokens"),
    [("clip-b32", 7 * 7 + 1), ("clip-l14-336", 24 * 24 + 1), ("siglip-224", 14 * 14), ("siglip-384-patch14", 27 * 27)],
)
def test_an_image_costs_its_patches_and_the_models_extra_tokens(card: str, num_tokens: int) -> None:
    pre = preprocessor(card)
    encoded = pre.prepare(photo("coffee"))
    assert pre.num_tokens == num_tokens == len(encoded)
    assert encoded.ids.dtype == np.int64 and not encoded.ids.any()
    rows = encoded.features["pixels"]
    assert rows.dtype == np.float32 and rows.shape == (num_tokens - CARDS[card][3], 3 * pre.patch_size**2)


@pytest.mark.parametrize("card", ["clip-b32", "siglip-384-patch14"])  # 384 = 27 patches of 14 and 6 pixels over
def test_patch_rows_times_the_conv_weight_equal_a_conv2d_patch_embedding(card: str) -> None:
    pre = preprocessor(card)
    pixel_values = pre.pixel_values(photo("astronaut"))
    p, hidden = pre.patch_size, 24
    conv = torch.nn.Conv2d(3, hidden, kernel_size=p, stride=p).double()
    with torch.no_grad():
        embedded = conv(torch.from_numpy(pixel_values).double()[None])  # [1, hidden, gh, gw]
    from_conv = embedded[0].flatten(1).T.numpy()  # [gh*gw, hidden], row-major over the grid
    rows = pre.prepare(photo("astronaut")).features["pixels"].astype(np.float64)
    weight, bias = conv.weight.detach().reshape(hidden, -1).numpy(), conv.bias.detach().numpy()
    assert embedded.shape[2:] == pre.grid
    np.testing.assert_allclose(rows @ weight.T + bias, from_conv, rtol=0, atol=1e-10)


def test_images_pack_into_one_batch_with_their_rows_in_a_feature_slot() -> None:
    pre = preprocessor("clip-b32")
    batch = Batch.pack([pre.prepare(photo(name)) for name in PHOTOS])
    assert batch.num_tokens == 3 * pre.num_tokens
    assert batch.features["pixels"].cu_rows.tolist() == [0, 49, 98, 147]
    assert batch.features["pixels"].values.shape == (147, 3 * 32 * 32)


# --- decoding as transformers loads images -------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(2, 9))
def test_exif_orientation_is_applied_as_transformers_load_image_applies_it(orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    sent = encode(photo("chelsea"), "JPEG", exif=exif.tobytes())
    decoded = decode_image(sent, **LIMITS, what=WHAT)
    theirs = load_image(Image.open(io.BytesIO(sent)))
    assert decoded.size == theirs.size
    assert np.array_equal(np.asarray(decoded), np.asarray(theirs))
    assert not np.array_equal(np.asarray(decoded), np.asarray(Image.open(io.BytesIO(sent)).convert("RGB")))
    pre = preprocessor("clip-b32")
    assert_same_pixels(pre.pixel_values(decoded), reference("clip-b32", theirs))


def with_alpha(image: Image.Image) -> Image.Image:
    """RGBA with an alpha ramp left to right: opaque, half and fully transparent pixels."""
    alpha = np.broadcast_to(np.linspace(0, 255, image.width).astype(np.uint8), (image.height, image.width))
    return Image.fromarray(np.dstack([np.asarray(image), alpha]))


MODES = {  # what a client may send: (file bytes); its mode when Pillow opens it
    "RGBA": lambda: encode(with_alpha(photo("chelsea")), "PNG"),
    "LA": lambda: encode(with_alpha(photo("chelsea")).convert("LA"), "PNG"),
    "L": lambda: encode(photo("coffee").convert("L"), "PNG"),
    "1": lambda: encode(photo("coffee").convert("1"), "PNG"),
    "P-transparent": lambda: encode(photo("chelsea").convert("P"), "PNG", transparency=0),
    "P-gif": lambda: encode(photo("chelsea").convert("P"), "GIF", transparency=7),
    "CMYK": lambda: encode(photo("astronaut").convert("CMYK"), "JPEG"),
    "L-jpeg": lambda: encode(photo("astronaut").convert("L"), "JPEG"),
    "RGB-webp": lambda: encode(photo("coffee"), "WEBP", lossless=True),
    "RGBA-webp": lambda: encode(with_alpha(photo("coffee")), "WEBP"),
    "RGB-bmp": lambda: encode(photo("chelsea"), "BMP"),
    "RGB-tiff": lambda: encode(photo("chelsea"), "TIFF"),
}


@pytest.mark.parametrize("kind", sorted(MODES))
def test_every_mode_becomes_rgb_as_the_processor_converts_it(kind: str) -> None:
    sent = MODES[kind]()
    ours = preprocessor("siglip-224").pixel_values(decode_image(sent, **LIMITS, what=WHAT))
    assert_same_pixels(ours, reference("siglip-224", Image.open(io.BytesIO(sent))))


def test_transparent_pixels_become_white() -> None:
    clear_black = Image.new("RGBA", (64, 48), (0, 0, 0, 0))
    decoded = decode_image(encode(clear_black, "PNG"), **LIMITS, what=WHAT)
    assert decoded.mode == "RGB" and (np.asarray(decoded) == 255).all()


def test_sixteen_bit_grayscale_keeps_its_high_byte_as_pillow_keeps_16_bit_colour() -> None:
    gray = np.asarray(photo("coffee").convert("L"))
    sixteen = encode(Image.fromarray(gray.astype(np.uint16) << 8 | 0x7F), "PNG")  # high byte: gray
    assert Image.open(io.BytesIO(sixteen)).mode == "I;16"
    ours = preprocessor("siglip-224").pixel_values(decode_image(sixteen, **LIMITS, what=WHAT))
    assert_same_pixels(ours, reference("siglip-224", Image.fromarray(gray)))


# --- refusals --------------------------------------------------------------------------------------------


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height over a few bytes of IDAT: the header of a
    decompression bomb, without ever holding its pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def refusal(data: bytes, **limits: int) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        decode_image(data, **{**LIMITS, **limits}, what=WHAT)
    assert WHAT in caught.value.message and caught.value.details["item"] == WHAT
    return caught.value


def test_a_file_over_max_bytes_is_payload_too_large() -> None:
    sent = photo_file("coffee", "PNG")
    error = refusal(sent, max_bytes=len(sent) - 1)
    assert isinstance(error, PayloadTooLarge)
    assert error.details["num_bytes"] == len(sent) and "smaller" in error.message


def test_a_declared_size_over_max_pixels_is_refused_before_decoding() -> None:
    error = refusal(png_header_only(5000, 4000), max_pixels=19_999_999)
    assert isinstance(error, PayloadTooLarge)
    assert (error.details["width"], error.details["height"]) == (5000, 4000) and "downscale" in error.message


def test_a_decompression_bomb_is_refused_without_pillows_global_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    limit = Image.MAX_IMAGE_PIXELS
    assert isinstance(refusal(png_header_only(100_000, 100_000)), PayloadTooLarge)  # Pillow's own check, first
    assert Image.MAX_IMAGE_PIXELS == limit  # left as it was
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # an application turned Pillow's off
    error = refusal(png_header_only(100_000, 100_000))
    assert isinstance(error, PayloadTooLarge) and error.details["width"] == 100_000


def test_corrupt_data_is_refused_as_undecodable() -> None:
    sent = bytearray(photo_file("chelsea", "PNG"))
    start = sent.find(b"IDAT") + 100
    sent[start : start + 40] = bytes(40)
    for corrupt in (bytes(sent), b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, b"\xff\xd8\xff" + bytes(200)):
        error = refusal(corrupt)
        assert not isinstance(error, PayloadTooLarge) and "cannot be decoded" in error.message


def test_a_truncated_jpeg_is_refused() -> None:
    sent = photo_file("astronaut", "JPEG")
    error = refusal(sent[: len(sent) // 2])
    assert error.details["format"] == "JPEG" and "truncated" in error.message


@pytest.mark.parametrize(
    "sent",
    [
        b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n",
        b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
        b"a cat on a mat",
        encode(photo("chelsea"), "ICO"),  # formats Pillow reads but shoal does not serve
        encode(photo("chelsea"), "PPM"),
        encode(photo("chelsea"), "TGA"),
    ],
    ids=["pdf", "svg", "text", "ico", "ppm", "tga"],
)
def test_an_unsupported_format_is_refused_naming_the_supported_ones(sent: bytes) -> None:
    error = refusal(sent)
    assert "PNG, JPEG, WebP, GIF, BMP or TIFF" in error.message


@pytest.mark.parametrize(
    "sent", [b"", png_header_only(0, 10), png_header_only(10, 0)], ids=["no-bytes", "0x10", "10x0"]
)
def test_an_empty_or_zero_sized_image_is_refused(sent: bytes) -> None:
    error = refusal(sent)
    assert not isinstance(error, PayloadTooLarge)
    assert "empty" in error.message or "zero size" in error.message


# --- configuration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"image_processor_type": "Siglip2ImageProcessor"},
        {},
        {**SIGLIP_224, "size": {"shortest_edge": 224, "longest_edge": 448}},
        {**SIGLIP_224, "size": 224},  # a shortest edge and no crop: no fixed size
        {**SIGLIP_224, "image_mean": [0.5, 0.5]},
    ],
    ids=["siglip2", "no-type", "longest-edge", "unfixed-size", "two-means"],
)
def test_a_config_these_processors_do_not_follow_fails_the_load(config: dict[str, object]) -> None:
    with pytest.raises(ModelLoadError, match="preprocessor_config.json"):
        ImagePreprocessor.from_config(config, 16, 0)


def test_patches_larger_than_the_image_fail_the_load() -> None:
    with pytest.raises(ModelLoadError, match="patches"):
        ImagePreprocessor.from_config(SIGLIP_224, 256, 0)
