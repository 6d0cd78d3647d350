"""A random-weight ColIdefics3 (the ColSmol page retriever's architecture) saved as a served
folder: config.json and weights as colpali-engine's `ColIdefics3.save_pretrained` writes them,
the processor's files as `ColIdefics3Processor.save_pretrained` writes them (preprocessor, image
sequence length, a word-level tokenizer with Idefics3's special tokens), and the card that serves
it. colpali-engine is the reference (`colpali()`), imported without its package `__init__`s: they
import every model family, and the Qwen2-VL ones import torchvision, which has no CPU build on
PyPI (see requirements/test-references.txt).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple

import transformers
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from vision_models import randomize

TILE, PATCH, SCALE = 32, 8, 2  # a tile is 4x4 patches, shuffled into 2x2 = 4 image tokens
LONGEST_EDGE = 4 * TILE  # up to 4x4 tiles and the global image
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE**2
MAX_LENGTH = 2048
DIM = 128  # ColIdefics3's projection (fixed in its __init__)
WORDS = ("User", ":", "Describe", "the", "image", ".", "Assistant", "a", "page", "about", "cats", "dogs", "tax")
# Idefics3's special tokens (the processor adds the first three if a tokenizer lacks them), the
# tile tags for up to 6x6 tiles and the chat frame of the visual prompt.
SPECIALS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
    "<|im_start|>",
)
TEXT_SHAPE = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=MAX_LENGTH,
)
VISION_SHAPE = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=TILE,
    patch_size=PATCH,
)
PROCESSOR_CONFIG = dict(
    do_image_splitting=True,
    size={"longest_edge": LONGEST_EDGE},
    max_image_size={"longest_edge": TILE},
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)


def colpali() -> types.SimpleNamespace:
    """colpali-engine's ColIdefics3 and ColIdefics3Processor, its modules loaded over empty parent
    packages (see the module's docstring)."""
    spec = importlib.util.find_spec("colpali_engine")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("colpali_engine")
    root = Path(spec.submodule_search_locations[0])
    for name in ("", ".models", ".models.idefics3", ".models.idefics3.colidefics3", ".utils"):
        full = "colpali_engine" + name
        if full not in sys.modules:
            package = types.ModuleType(full)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            # A spec, so that importlib.util.find_spec still answers for the package.
            package.__spec__ = importlib.machinery.ModuleSpec(full, None, is_package=True)
            package.__spec__.submodule_search_locations = package.__path__
            sys.modules[full] = package
    from colpali_engine.models.idefics3.colidefics3.modeling_colidefics3 import ColIdefics3
    from colpali_engine.models.idefics3.colidefics3.processing_colidefics3 import ColIdefics3Processor

    return types.SimpleNamespace(ColIdefics3=ColIdefics3, ColIdefics3Processor=ColIdefics3Processor)


class TinyColSmol(NamedTuple):
    reference: Any  # colpali-engine's ColIdefics3 of the folder's weights
    processor: Any  # colpali-engine's ColIdefics3Processor (the PIL image processor)
    card: dict  # the card's fields: parse_card takes them


def write_tokenizer(directory: Path, words: tuple[str, ...]) -> dict[str, int]:
    """A word-level tokenizer.json: <unk> 0, <pad> 1, then Idefics3's special tokens, then `words`."""
    vocab = {"<unk>": 0, "<pad>": 1}
    for token in (*SPECIALS, *words):
        vocab.setdefault(token, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<pad>", *SPECIALS)])
    tokenizer.save(str(directory / "tokenizer.json"))
    return vocab


def tiny_colsmol(directory: Path, *, model_id: str, words: tuple[str, ...] = WORDS, **processor: Any) -> TinyColSmol:
    """A random-weight ColIdefics3 and its processor saved in `directory`; `processor` overrides
    PROCESSOR_CONFIG's image preprocessing."""
    ref = colpali()
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory, words)
    config = transformers.Idefics3Config(
        text_config=dict(TEXT_SHAPE, vocab_size=len(vocab), pad_token_id=1),
        vision_config=VISION_SHAPE,
        scale_factor=SCALE,
        image_token_id=vocab["<image>"],
        pad_token_id=1,
    )
    reference = ref.ColIdefics3(config).eval()
    reference.set_attn_implementation("eager")
    randomize(reference)
    reference.save_pretrained(directory)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), pad_token="<pad>", unk_token="<unk>"
    )
    image_processor = transformers.Idefics3ImageProcessorPil(**{**PROCESSOR_CONFIG, **processor})
    proc = ref.ColIdefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN)
    proc.save_pretrained(directory)
    card = {
        "id": model_id,
        "architecture": "idefics3",
        "source": {"path": str(directory)},
        "max_length": MAX_LENGTH,
        "modalities": ["text", "image"],
        "image_tokens": image_tokens(),
        "image_prompt": proc.visual_prompt_prefix,
        "dimensions": TEXT_SHAPE["hidden_size"],
        "outputs": ["multivector"],
        "tasks": ["encode", "score"],
        "multivector": {
            "dim": DIM,
            "weight": "linear.weight",
            "bias": "linear.bias",
            "query_suffix": proc.query_augmentation_token * 10,
        },
    }
    return TinyColSmol(reference, proc, card)


def image_tokens() -> int:
    """The most tokens one image can take: every tile of the largest grid and the global image."""
    tiles = (LONGEST_EDGE // TILE) ** 2 + 1
    return tiles * (IMAGE_SEQ_LEN + 2)
