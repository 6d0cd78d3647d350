"""shoal's Idefics3 page-image tiling (engine/tiled_images.py) against transformers'
`Idefics3ImageProcessorPil` (what ColSmol's ColIdefics3Processor runs), on the photos scikit-image
ships sent as PNG and JPEG bytes: the tiles' patch rows and the rows x cols grid for several
configs (a grid of tiles, a 2x3 grid, a lone tile, an odd first resize, strips one pixel wide, and
ColSmol's own 2048 / 512 / 16); the prompt's ids against colpali-engine's `process_images` on the
random-weight folder of tests/page_models.py; and each refusal of a bad upload or a folder this
module does not follow."""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import transformers
from PIL import Image
from skimage import data as photos

import page_models
from shoal.catalog import parse_card
from shoal.engine.images import decode_image
from shoal.engine.tiled_images import TiledImageInputs, TiledImagePreprocessor, image_prompt, load_tiled_inputs
from shoal.engine.tokenizer import TextTokenizer
from shoal.errors import InvalidRequest, ModelLoadError, PayloadTooLarge

LIMITS = dict(max_bytes=8 << 20, max_pixels=4_000_000)
TINY = page_models.PROCESSOR_CONFIG  # longest edge 128, 32-pixel tiles: up to 4x4 tiles
# name: (preprocessor config, patch size)
CONFIGS = {
    "tiny": (TINY, page_models.PATCH),
    "longest-96": ({**TINY, "size": {"longest_edge": 96}}, page_models.PATCH),  # coffee's 3:2 -> 2x3 tiles
    "one-tile": ({**TINY, "size": {"longest_edge": 32}}, page_models.PATCH),  # every image is a lone tile
    # an odd longest edge: a square's other side is rounded up to even, one pixel longer
    "odd-edge": ({**TINY, "size": {"longest_edge": 63}, "max_image_size": {"longest_edge": 21}}, 7),
    "bilinear-unnormalised": ({**TINY, "resample": 2, "do_normalize": False}, page_models.PATCH),
}
COLSMOL = {  # vidore/colSmol-256M's image processor (SmolVLM-256M's)
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Idefics3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 512},
    "resample": 1,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 2048},
}
# 512x512, 600x400, 451x300, and strips one pixel high or wide (the most extreme aspect ratios)
PHOTOS = ("astronaut", "coffee", "chelsea", "wide-strip", "tall-strip")


@functools.cache
def photo(name: str) -> Image.Image:
    if name.endswith("strip"):
        pixels = photos.astronaut()
        return Image.fromarray(pixels[:1] if name == "wide-strip" else pixels[:, :1])
    return Image.fromarray(getattr(photos, name)())


@functools.cache
def photo_file(name: str, image_format: str) -> bytes:
    buffer = io.BytesIO()
    photo(name).save(buffer, format=image_format)
    return buffer.getvalue()


def patch_rows(pixel_values: np.ndarray, patch: int) -> np.ndarray:
    """The processor's `[tiles, C, t, t]` as patch rows: per tile its patches row-major, each
    flattened (channel, row, col), a Conv2d patch embedding's order."""
    tiles, channels, side, _ = pixel_values.shape
    grid = side // patch
    patches = pixel_values.reshape(tiles, channels, grid, patch, grid, patch).transpose(0, 2, 4, 1, 3, 5)
    return patches.reshape(tiles * grid * grid, channels * patch * patch)


def reference(config: dict, sent: bytes) -> tuple[np.ndarray, int, int]:
    """transformers' pixel values for the image in `sent`, and its rows and cols."""
    processor = transformers.Idefics3ImageProcessorPil(**config)
    out = processor(images=[Image.open(io.BytesIO(sent))], return_row_col_info=True, return_tensors="np")
    (pixel_values,) = out["pixel_values"]  # one image: [tiles, C, t, t]
    return pixel_values, out["rows"][0][0], out["cols"][0][0]


def assert_same_tiles(config: dict, patch: int, sent: bytes) -> tuple[int, int]:
    ours, rows, cols = TiledImagePreprocessor.from_config(config, patch).tiles(decode_image(sent, **LIMITS, what="x"))
    pixel_values, want_rows, want_cols = reference(config, sent)
    want = patch_rows(pixel_values, patch)
    assert (rows, cols) == (want_rows, want_cols)
    assert ours.dtype == np.float32 and ours.shape == want.shape
    assert np.array_equal(ours, want), f"max |diff| {np.abs(ours - want).max()}"
    return rows, cols


# --- pixels --------------------------------------------------------------------------------------


@pytest.mark.parametrize("image_format", ["PNG", "JPEG"])
@pytest.mark.parametrize("name", PHOTOS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_tiles_equal_the_transformers_processor_exactly(config: str, name: str, image_format: str) -> None:
    assert_same_tiles(*CONFIGS[config], photo_file(name, image_format))


def test_the_configs_reach_a_grid_a_two_by_three_grid_a_lone_tile_and_strips() -> None:
    assert assert_same_tiles(*CONFIGS["tiny"], photo_file("astronaut", "PNG")) == (4, 4)
    assert assert_same_tiles(*CONFIGS["longest-96"], photo_file("coffee", "PNG")) == (2, 3)
    assert assert_same_tiles(*CONFIGS["one-tile"], photo_file("chelsea", "PNG")) == (0, 0)
    assert assert_same_tiles(*CONFIGS["tiny"], photo_file("wide-strip", "PNG")) == (1, 4)
    assert assert_same_tiles(*CONFIGS["tiny"], photo_file("tall-strip", "PNG")) == (4, 1)


def test_colsmols_own_config_tiles_a_photo_as_transformers_does() -> None:
    assert assert_same_tiles(COLSMOL, 16, photo_file("coffee", "JPEG")) == (3, 4)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_max_tiles_is_a_square_images_count_and_no_photo_passes_it(config: str) -> None:
    settings, patch = CONFIGS[config]
    images = TiledImagePreprocessor.from_config(settings, patch)
    square, _, _ = reference(settings, photo_file("astronaut", "PNG"))
    assert images.max_tiles() == square.shape[0]
    for name in PHOTOS:
        rows, cols = images.grid(photo(name).height, photo(name).width)
        assert rows * cols + 1 <= images.max_tiles()


def test_missing_config_keys_take_the_processor_class_defaults() -> None:
    ours = TiledImagePreprocessor.from_config({"image_processor_type": "Idefics3ImageProcessor"}, 14)
    theirs = transformers.Idefics3ImageProcessorPil()
    assert (ours.longest_edge, ours.tile) == (theirs.size["longest_edge"], theirs.max_image_size["longest_edge"])
    assert ours.resample == theirs.resample and ours.rescale_factor == theirs.rescale_factor
    assert ours.image_mean == tuple(theirs.image_mean) and ours.image_std == tuple(theirs.image_std)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"do_image_splitting": False}, "do_image_splitting"),
        ({"do_resize": False}, "do_resize"),
        ({"max_image_size": {"longest_edge": 30}}, "max_image_size"),  # not a multiple of 8
        ({"size": {"height": 128, "width": 128}}, "size"),
        ({"size": 128}, "size"),
        ({"image_processor_type": "SiglipImageProcessor"}, "image_processor_type"),
        ({"resample": "lanczos"}, "resample"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"image_std": [0.5, "half", 0.5]}, "image_std"),
        ({"rescale_factor": "1/255"}, "rescale_factor"),
    ],
)
def test_a_config_this_module_does_not_follow_is_refused_naming_its_key(change: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        TiledImagePreprocessor.from_config({**TINY, **change}, page_models.PATCH)


# --- the prompt, against colpali-engine ----------------------------------------------------------


@pytest.fixture(scope="module")
def colsmol(tmp_path_factory: pytest.TempPathFactory) -> tuple[page_models.TinyColSmol, Path]:
    if importlib.util.find_spec("colpali_engine") is None:  # not imported: see page_models.colpali
        pytest.skip("colpali-engine (requirements/test-references.txt) is not installed")
    directory = tmp_path_factory.mktemp("colsmol")
    return page_models.tiny_colsmol(directory, model_id="test/colsmol"), directory


def load(
    tiny: page_models.TinyColSmol, directory: Path, *, max_length: int = 2048, **options: object
) -> TiledImageInputs:
    settings: dict = dict(
        tokenizer=TextTokenizer.from_dir(directory, max_length),
        patch_size=page_models.PATCH,
        tile_size=page_models.TILE,
        image_token_id=tiny.reference.config.image_token_id,
        prompt=tiny.processor.visual_prompt_prefix,
        limits=None,
    )
    return load_tiled_inputs(parse_card(tiny.card, "<test>"), directory, **{**settings, **options})


@pytest.mark.parametrize("rows, cols", [(0, 0), (1, 4), (2, 3), (4, 4)])
def test_image_prompt_is_the_processors_replacement_for_one_image(colsmol, rows: int, cols: int) -> None:
    tiny, _ = colsmol
    want = tiny.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, image_idx=0)
    assert image_prompt(rows, cols, page_models.IMAGE_SEQ_LEN) == want


@pytest.mark.parametrize("name, image_format", [("astronaut", "PNG"), ("coffee", "JPEG"), ("tall-strip", "PNG")])
def test_prepare_gives_colpali_engines_ids_and_pixels_for_a_page(colsmol, name: str, image_format: str) -> None:
    tiny, directory = colsmol
    sent = photo_file(name, image_format)
    (ours,) = load(tiny, directory).prepare([sent], False, first_index=0, what="items")
    want = tiny.processor.process_images([Image.open(io.BytesIO(sent))])  # one image: no padding
    assert ours.ids.tolist() == want["input_ids"][0].tolist()
    assert np.array_equal(ours.features["pixels"], patch_rows(want["pixel_values"][0].numpy(), page_models.PATCH))


def test_max_tokens_is_a_square_pages_prompt_and_prepare_names_each_image(colsmol) -> None:
    tiny, directory = colsmol
    inputs = load(tiny, directory)
    square = tiny.processor.process_images([Image.new("RGB", (7, 7), "white")])
    assert inputs.max_tokens() == square["input_ids"].shape[1]
    files = [photo_file("coffee", "PNG"), photo_file("chelsea", "JPEG")]
    sequences = inputs.prepare(files, False, first_index=5, what="items")
    for sequence, sent in zip(sequences, files):
        (want,) = inputs.prepare([sent], False, first_index=0, what="items")
        assert sequence.ids.tolist() == want.ids.tolist()


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sent, problem",
    [(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, "cannot be decoded"), (b"", "empty"), (b"%PDF-1.4\n", "not an image")],
)
def test_a_bad_upload_is_refused_naming_the_item(colsmol, sent: bytes, problem: str) -> None:
    tiny, directory = colsmol
    with pytest.raises(InvalidRequest) as caught:
        load(tiny, directory).prepare([photo_file("coffee", "PNG"), sent], False, first_index=2, what="items")
    assert not isinstance(caught.value, PayloadTooLarge)
    assert caught.value.details["item"] == "items[3]" and problem in caught.value.message


def test_an_oversized_upload_is_payload_too_large(colsmol) -> None:
    tiny, directory = colsmol
    sent = photo_file("coffee", "PNG")
    inputs = replace(load(tiny, directory), max_bytes=len(sent) - 1)
    with pytest.raises(PayloadTooLarge) as caught:
        inputs.prepare([sent], False, first_index=4, what="items")
    assert caught.value.details["item"] == "items[4]"


def test_a_tokenizer_that_does_not_give_the_image_token_fails_at_load_and_in_prepare(colsmol) -> None:
    tiny, directory = colsmol
    pad_id = TextTokenizer.from_dir(directory, 2048).token_id("<pad>")
    with pytest.raises(ModelLoadError, match=r"model test/colsmol: .*does not keep <image> whole"):
        load(tiny, directory, image_token_id=pad_id)
    inputs = replace(load(tiny, directory), image_token_id=pad_id)
    with pytest.raises(ModelLoadError, match="does not keep <image> whole"):
        inputs.prepare([photo_file("coffee", "PNG")], False, first_index=0, what="items")


def test_a_max_length_shorter_than_the_largest_pages_prompt_fails_the_load(colsmol) -> None:
    tiny, directory = colsmol
    with pytest.raises(ModelLoadError, match="4x4-tile image is longer than the model's max_length of 50"):
        load(tiny, directory, max_length=50)


def test_a_tile_that_is_not_the_towers_image_size_fails_the_load(colsmol) -> None:
    tiny, directory = colsmol
    with pytest.raises(ModelLoadError, match="cuts 32-pixel tiles; its vision tower takes 64-pixel images"):
        load(tiny, directory, tile_size=64)


def test_a_prompt_without_one_image_token_fails_the_load(colsmol) -> None:
    tiny, directory = colsmol
    with pytest.raises(ModelLoadError, match="has 2 <image>, not one"):
        load(tiny, directory, prompt="<image><image>Describe the image.")


def copy_folder(directory: Path, target: Path, processor_config: dict, preprocessor_config: dict | None) -> Path:
    target.mkdir()
    shutil.copy(directory / "tokenizer.json", target)
    (target / "processor_config.json").write_text(json.dumps(processor_config))
    if preprocessor_config is not None:
        (target / "preprocessor_config.json").write_text(json.dumps(preprocessor_config))
    return target


def test_an_older_folders_preprocessor_config_is_read_and_the_nested_one_wins_as_in_transformers(
    colsmol, tmp_path: Path
) -> None:
    tiny, directory = colsmol
    nested = json.loads((directory / "processor_config.json").read_text())
    image_processor = nested.pop("image_processor")
    older = copy_folder(directory, tmp_path / "older", nested, image_processor)
    assert load(tiny, older).images == load(tiny, directory).images
    both = copy_folder(
        directory,
        tmp_path / "both",
        {**nested, "image_processor": image_processor},
        {**image_processor, "size": {"longest_edge": 64}},
    )
    theirs = transformers.AutoImageProcessor.from_pretrained(both)
    assert load(tiny, both).images.longest_edge == theirs.size["longest_edge"] == TINY["size"]["longest_edge"]


@pytest.mark.parametrize(
    "processor_config, preprocessor_config, problem",
    [
        ({"image_seq_len": 4}, None, "has no image processor"),
        ({"image_processor": TINY}, None, "image_seq_len .* is None"),
        ({"image_processor": {**TINY, "do_image_splitting": False}, "image_seq_len": 4}, None, "do_image_splitting"),
        ({"image_seq_len": 4}, {**TINY, "size": {"height": 9, "width": 9}}, "preprocessor_config.json: size"),
    ],
)
def test_a_folder_this_module_does_not_follow_fails_the_load_naming_the_key(
    colsmol, tmp_path: Path, processor_config: dict, preprocessor_config: dict | None, problem: str
) -> None:
    tiny, directory = colsmol
    folder = copy_folder(directory, tmp_path / "folder", processor_config, preprocessor_config)
    with pytest.raises(ModelLoadError, match=f"model test/colsmol: .*{problem}"):
        load(tiny, folder)
