"""shoal's CLIP against open_clip (PyPI `open_clip_torch`), the library LAION's CLIP checkpoints
come from, on random-weight folders that open_clip writes (`save_for_hf`, as its hub uploads are
written: open_clip_config.json, its `CLIP` state dict as open_clip_model.safetensors or
open_clip_pytorch_model.bin, the tokenizer's files) and reads back (`create_model("local-dir:...")`).

- `build_model` reads such a folder in open_clip's layout: image and text features equal open_clip's
  `encode_image` / `encode_text`, and the logits its `logit_scale` gives, with exact GELU (LAION's
  models) and quick GELU (OpenAI's, open_clip's `-quickgelu`).
- the engine serves one (beside the transformers-side files LAION's hub repos ship): photos' PNG
  bytes through shoal's decode and preprocessing, texts through the folder's tokenizer.json,
  equal open_clip's normalized features of the same texts through its own tokenizer (`HFTokenizer`
  over that file) and of the images through transformers' CLIPImageProcessor configured from
  open_clip's `preprocess_cfg`.
- a transformers CLIP tokenizer.json with open_clip's vocabulary (what LAION's hub repos ship)
  read by shoal gives open_clip's `SimpleTokenizer` ids.
- which layout a folder is read in, and a folder in none is a ModelLoadError naming the layouts.

torchvision: open_clip imports it at module level, and PyPI builds it for CUDA torch only, where
the CPU torch under test cannot import it (its nms kernel fails to register, pytorch/vision#9085)
and transformers then fails too (it imports torchvision whenever it is installed). So it is not
installed, and open_clip is imported over placeholders of the few torchvision names it imports at
module level; its models, loader and tokenizers never call them. Only its image transform needs the
real one: the test that compares it with shoal's preprocessing runs where torchvision imports.
"""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path
from types import ModuleType
from unittest import mock

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from skimage import data as photos
from tokenizers import Tokenizer, models, pre_tokenizers, processors

import engine_calls
from shoal.calls import EncodeCall, Item
from shoal.catalog import Catalog, parse_card
from shoal.engine.images import decode_image
from shoal.engine.open_clip_images import from_open_clip, preprocessor_config
from shoal.engine.tokenizer import TextTokenizer
from shoal.errors import ModelLoadError
from shoal.models.clip import config_from_open_clip
from shoal.weights import build_model, checkpoint_layout, estimate_bytes
from test_clip_parity import max_diff, packed, run

VOCAB, CONTEXT = 99, 16
SOT, EOT = VOCAB - 2, VOCAB - 1  # open_clip pools at the largest id: the end-of-text token's
EOS_ID = 5  # or, with text_cfg pool_type "eos", at the first of this id
IMAGE, PATCH = 32, 8  # 16 patches an image, and the class token
TOKENS_PER_IMAGE = (IMAGE // PATCH) ** 2 + 1
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # OPENAI_DATASET_*
ATOL = 1e-4
WORDS = ["a", "photo", "of", "cat", "dog", "red", "coffee", "cup", "on", "the", "table", "astronaut"]
TEXTS = ["a photo of a cat", "a red coffee cup on the table", "the astronaut", "dog"]


def model_cfg(quick_gelu: bool, **text: object) -> dict:
    """open_clip's `model_cfg` of a small ViT CLIP: towers of unequal widths, a vision MLP ratio and
    head width off open_clip's defaults, so that a misread setting changes the outputs; `text`
    overrides text_cfg's settings."""
    return {
        "embed_dim": 24,
        "quick_gelu": quick_gelu,
        "vision_cfg": {
            "image_size": IMAGE,
            "patch_size": PATCH,
            "width": 48,
            "layers": 2,
            "head_width": 12,
            "mlp_ratio": 3.0,
        },
        "text_cfg": {
            "context_length": CONTEXT,
            "vocab_size": VOCAB,
            "width": 32,
            "heads": 4,
            "layers": 2,
            # open_clip's HFTokenizer over the folder's tokenizer.json (SimpleTokenizer's 49408 ids
            # do not fit a 99-token table)
            "hf_tokenizer_name": "tokenizer.json",
            **text,
        },
    }


# --- open_clip ------------------------------------------------------------------------------------

_TORCHVISION_NAMES = ["torchvision", "torchvision.ops", "torchvision.ops.misc", "torchvision.transforms"]
_TORCHVISION_NAMES.append("torchvision.transforms.functional")


@pytest.fixture(scope="module")
def open_clip() -> ModuleType:
    """open_clip, over torchvision placeholders where torchvision is not installed (see the module's
    docstring); they leave sys.modules once it is imported."""
    if importlib.util.find_spec("torchvision") is not None:
        import open_clip

        return open_clip
    missing = [name for name in _TORCHVISION_NAMES if name not in sys.modules]
    sys.modules.update({name: mock.MagicMock(name=name) for name in missing})
    try:
        import open_clip
    finally:
        for name in missing:
            del sys.modules[name]
    return open_clip


def randomize(model: torch.nn.Module) -> None:
    """Every parameter drawn from one seeded generator, by open_clip's names: norms (ln_*) near 1 and
    0, biases nonzero, tables and the class token at unit scale, matrices at unit-variance
    activations ([out, in] weights and open_clip's [in, out] projections alike)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name == "logit_scale":
                p.fill_(2.3)
            elif name.startswith("ln_") or ".ln_" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embedding" in name:
                p.copy_(noise)
            elif name in ("text_projection", "visual.proj"):
                p.copy_(noise * p.shape[0] ** -0.5)
            else:
                p.copy_(noise * p[0].numel() ** -0.5)


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer.json that frames a text as open_clip's tokenizer does: start-of-text,
    the words, end-of-text (the largest id); pads are 0, as open_clip pads."""
    vocab = {"<pad>": 0, "<unk>": 1, "<|startoftext|>": SOT, "<|endoftext|>": EOT}
    vocab.update({word: 10 + i for i, word in enumerate(WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", SOT), ("<|endoftext|>", EOT)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def save_open_clip(open_clip: ModuleType, directory: Path, cfg: dict, safe_serialization: bool | str) -> None:
    """A random open_clip CLIP of `cfg` saved by open_clip's `save_for_hf`: open_clip_config.json
    (model_cfg and preprocess_cfg), the state dict (safetensors, torch pickle or "both") and the
    tokenizer."""
    write_tokenizer(directory)
    tokenizer = open_clip.tokenizer.HFTokenizer(str(directory), context_length=CONTEXT)
    torch.manual_seed(0)
    model = open_clip.CLIP(**cfg).eval()
    randomize(model)
    model.visual.image_mean, model.visual.image_std = tuple(MEAN), tuple(STD)  # as create_model sets them
    save_for_hf = importlib.import_module(
        "open_clip.push_to_hf_hub"
    ).save_for_hf  # the package re-exports a function by that name
    save_for_hf(model, tokenizer, cfg, str(directory), safe_serialization=safe_serialization)


def load_reference(open_clip: ModuleType, directory: Path) -> torch.nn.Module:
    return open_clip.create_model(f"local-dir:{directory}").eval()


@pytest.fixture(
    scope="module",
    params=[
        (model_cfg(False), False),
        (model_cfg(True), True),
        (model_cfg(False, pool_type="eos", eos_id=EOS_ID), False),
    ],
    ids=["laion-gelu-bin", "openai-quickgelu-safetensors", "eos-pooled"],
)
def folder(request, open_clip, tmp_path_factory):
    """(open_clip's model read back by open_clip, shoal's read by `build_model`, the folder)."""
    cfg, safetensors = request.param
    directory = tmp_path_factory.mktemp("open_clip")
    save_open_clip(open_clip, directory, cfg, safetensors)
    expected = "open_clip_model.safetensors" if safetensors else "open_clip_pytorch_model.bin"
    assert sorted(p.name for p in directory.glob("open_clip_*")) == sorted(["open_clip_config.json", expected])
    return load_reference(open_clip, directory), build_model(directory, None, "cpu"), directory


# --- inputs ---------------------------------------------------------------------------------------


def random_texts(lengths: list[int]) -> list[torch.Tensor]:
    """Start-of-text, random ids below it, end-of-text (the largest id); `EOS_ID` third in texts of
    five tokens or more, so that pooling at it differs from pooling at the largest id."""
    g = torch.Generator().manual_seed(1)
    texts = [
        torch.cat([torch.tensor([SOT]), torch.randint(EOS_ID + 1, SOT, (n - 2,), generator=g), torch.tensor([EOT])])
        for n in lengths
    ]
    for text in texts:
        if len(text) >= 5:
            text[2] = EOS_ID
    return texts


def open_clip_ids(texts: list[torch.Tensor]) -> torch.Tensor:
    """`[B, CONTEXT]`: the texts right-padded with 0, as open_clip's tokenizers hand them over."""
    return torch.stack([torch.nn.functional.pad(t, (0, CONTEXT - len(t))) for t in texts])


def random_images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(3))  # [n, C, S, S]


# --- build_model on open_clip's folder -------------------------------------------------------------


def test_an_open_clip_folder_loads_with_open_clips_image_and_text_features_and_logits(folder):
    reference, ours, _ = folder
    images, texts = random_images(3), random_texts([5, CONTEXT, 2, 9])
    got = run(ours, packed([*texts, *images], TOKENS_PER_IMAGE))  # [7, 24]
    with torch.no_grad():
        want_texts, want_images = reference.encode_text(open_clip_ids(texts)), reference.encode_image(images)
        _, logits_per_text = reference.get_logits(images, open_clip_ids(texts))  # [4, 3]
    assert max_diff(got[:4], want_texts) <= ATOL, "text features differ"
    assert max_diff(got[4:], want_images) <= ATOL, "image features differ"
    assert max_diff(ours.logits(got[:4], got[4:]), logits_per_text) <= ATOL * 10  # scaled by exp(2.3) ~ 10
    assert ours.max_positions == CONTEXT and ours.tokens_per_image == TOKENS_PER_IMAGE


@pytest.mark.parametrize(
    ("where", "setting"),
    [
        ("text_cfg", {"no_causal_mask": True}),
        ("text_cfg", {"pool_type": "last"}),
        ("text_cfg", {"proj_bias": True}),
        ("vision_cfg", {"timm_model_name": "vit_base_patch16_224"}),
        ("vision_cfg", {"layers": [3, 4, 6, 3]}),
        ("vision_cfg", {"ls_init_value": 1e-5}),
        ("model_cfg", {"custom_text": True}),
    ],
)
def test_open_clip_settings_shoals_clip_does_not_compute_are_refused_naming_them(where, setting):
    cfg = model_cfg(False)
    (cfg if where == "model_cfg" else cfg[where]).update(setting)
    key = next(iter(setting))
    with pytest.raises(ValueError, match=rf"{where}\.{key}|{where}\.layers is a list"):
        config_from_open_clip({"model_cfg": cfg})


def test_an_unsupported_open_clip_folder_is_a_model_load_error_naming_the_setting(folder, tmp_path):
    _, _, directory = folder
    for path in directory.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "open_clip_config.json").read_text())
    config["model_cfg"]["text_cfg"]["embed_cls"] = True
    (tmp_path / "open_clip_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"open_clip_config\.json: text_cfg\.embed_cls = True"):
        build_model(tmp_path, None, "cpu")


# --- which layout a folder is read in -------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "layout", "weights"),
    [
        # LAION's hub repos: both layouts, read in transformers' (open_clip_model.safetensors is no shard of it)
        (
            ["config.json", "model.safetensors", "open_clip_config.json", "open_clip_model.safetensors"],
            "config.json",
            ["model.safetensors"],
        ),
        # transformers' side files without its weights: read in open_clip's
        (
            ["config.json", "open_clip_config.json", "open_clip_pytorch_model.bin"],
            "open_clip_config.json",
            ["open_clip_pytorch_model.bin"],
        ),
        (
            ["open_clip_config.json", "open_clip_pytorch_model.bin", "open_clip_model.safetensors"],
            "open_clip_config.json",
            ["open_clip_model.safetensors"],
        ),
        # a GLiNER folder: weights beside a config of its own, which its loader reads
        (["gliner_config.json", "pytorch_model.bin"], "config.json", ["pytorch_model.bin"]),
    ],
)
def test_a_folder_is_read_in_the_first_layout_whose_config_and_weights_it_holds(tmp_path, files, layout, weights):
    for name in files:
        (tmp_path / name).touch()
    got, paths = checkpoint_layout(tmp_path)
    assert got.config_file == layout and [p.name for p in paths] == weights


def test_a_folder_in_no_layout_is_a_model_load_error_naming_the_layouts_shoal_reads(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no checkpoint .* config\.json with .*, or open_clip_config\.json with"):
        build_model(tmp_path, "clip", "cpu")
    (tmp_path / "open_clip_model.safetensors").touch()
    with pytest.raises(ModelLoadError, match=r"weights with no config file beside them"):
        build_model(tmp_path, "clip", "cpu")


# --- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(open_clip, tmp_path_factory):
    """(open_clip's model, its tokenizer, the card) for an open_clip folder with what LAION's hub
    repos ship beside it: a preprocessor_config.json and a transformers config.json (what the
    card's folder must hold) of the same model."""
    directory = tmp_path_factory.mktemp("served")
    save_open_clip(open_clip, directory, model_cfg(False), safe_serialization="both")
    open_clip_config = json.loads((directory / "open_clip_config.json").read_text())
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(open_clip_config)))
    (directory / "config.json").write_text(json.dumps(config_from_open_clip(open_clip_config)))
    card = parse_card(
        {
            "id": "test/open-clip",
            "architecture": "clip",
            "source": {"path": str(directory)},
            "max_length": CONTEXT,
            "modalities": ["text", "image"],
            "image_tokens": TOKENS_PER_IMAGE,
            "pooling": "model",
            "dimensions": 24,
            "outputs": ["dense"],
            "tasks": ["encode", "score"],
        },
        "<test>",
    )
    reference = load_reference(open_clip, directory)
    return reference, open_clip.get_tokenizer(f"local-dir:{directory}"), open_clip_config, card


def run_engine(card, *calls):
    return engine_calls.run(Catalog([card]), *calls)


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


# Photos whose crop offset torchvision and transformers round alike (see open_clip_images.py).
PHOTOS = [photos.astronaut(), photos.coffee(), photos.chelsea()]


def test_the_engine_serves_an_open_clip_folder_with_open_clips_normalized_features(served):
    reference, tokenizer, open_clip_config, card = served
    files = [png(photo) for photo in PHOTOS]
    images, texts = run_engine(card, EncodeCall(card.id, [Item(image=f) for f in files]), EncodeCall(card.id, TEXTS))
    processor = transformers.CLIPImageProcessorPil(**preprocessor_config(open_clip_config))
    pixels = processor([Image.open(io.BytesIO(f)).convert("RGB") for f in files], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want_images = reference.encode_image(pixels, normalize=True).numpy()
        want_texts = reference.encode_text(tokenizer(TEXTS), normalize=True).numpy()
    np.testing.assert_allclose(np.stack(images.vectors), want_images, atol=ATOL)
    np.testing.assert_allclose(np.stack(texts.vectors), want_texts, atol=ATOL)
    # open_clip's tokenizer pads to its context length; shoal's sends the text alone
    assert texts.num_tokens == sum(int((row != 0).sum()) for row in tokenizer(TEXTS))


def test_a_folder_with_open_clips_weights_in_two_files_costs_one_of_them(served):
    reference, _, _, card = served
    directory = Path(str(card.source.path))
    assert {"open_clip_model.safetensors", "open_clip_pytorch_model.bin"} <= {p.name for p in directory.iterdir()}
    assert estimate_bytes(directory) == sum(t.numel() * 4 for t in reference.state_dict().values())


# --- preprocessing and tokenizer ------------------------------------------------------------------


def test_open_clips_image_transform_gives_shoals_pixels_but_where_its_crop_offset_rounds_half_to_even(open_clip):
    """Measured against torchvision: equal pixels (float32 ToTensor and shoal's float64 rescale round
    alike), except that a crop leaving 3 modulo 4 pixels (skimage's rocket: 47 columns for 32)
    starts one pixel further along in open_clip: shoal's pixels are open_clip's shifted by one."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision (open_clip's image transform) does not import beside this CPU torch")
    config = {"model_cfg": model_cfg(False), "preprocess_cfg": {"mean": MEAN, "std": STD}}
    transform = open_clip.image_transform(IMAGE, is_train=False, mean=MEAN, std=STD)
    ours = from_open_clip(config, PATCH, 1)
    for photo in [*PHOTOS, photos.rocket()]:
        data = png(photo)
        got = ours.pixel_values(decode_image(data, max_bytes=1 << 30, max_pixels=1 << 30, what="photo"))
        want = transform(Image.open(io.BytesIO(data))).numpy()
        if photo.shape[:2] == photos.rocket().shape[:2]:
            assert np.abs(got - want).max() > 0.5
            got, want = got[:, :, 1:], want[:, :, :-1]
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_transformers_clip_tokenizer_json_of_open_clips_vocabulary_gives_its_simple_tokenizer_ids(
    open_clip, tmp_path
):
    simple = open_clip.tokenizer.SimpleTokenizer()
    # open_clip names the special tokens <start_of_text> / <end_of_text>; OpenAI's vocab.json (and
    # LAION's repos) <|startoftext|> / <|endoftext|>, at the same ids
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    vocab = {names.get(token, token): index for token, index in simple.encoder.items()}
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.__getitem__)
    transformers.CLIPTokenizer(vocab=vocab, merges=merges).save_pretrained(tmp_path)
    texts = [
        *TEXTS,
        "A Red Coffee-Cup, on the TABLE!",
        "the astronaut's helmet in 1969",
        "naïve café déjà vu",
        "  spaces   and\ttabs ",
        "don't you'll we've",
        "日本語のテキスト",
    ]
    got = [list(encoded.ids) for encoded in TextTokenizer.from_dir(tmp_path, 77).encode(texts, truncate=True)]
    want = [[int(i) for i in row if i != 0] for row in simple(texts, context_length=77)]
    assert got == want
