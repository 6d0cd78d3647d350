"""Random-weight CLIP and SigLIP checkpoints for the vision tests: small tower shapes, every
parameter drawn so that a swapped, skipped or misread tensor changes the outputs, and `tiny_clip`,
a whole served folder (weights, preprocessor config, tokenizer) with its card."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

VOCAB = 99
MAX_TEXT = 24
IMAGE, PATCH, CHANNELS = 32, 8, 3  # 16 patches an image
TEXT_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=MAX_TEXT,
)
VISION_SHAPE = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE,
    patch_size=PATCH,
    num_channels=CHANNELS,
)
LEGACY_EOS, EOS = 2, 5  # CLIP's two end-of-text rules: the largest id (eos 2), or the first eos id
PAD = 1
BOS, SIGLIP_EOS = VOCAB - 2, VOCAB - 1  # CLIP's <|startoftext|>, SigLIP's </s>
ATOL = 1e-4
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
TEMPLATE = "This is a photo of {}."  # the hypothesis template of a card with an image_labels extract


def randomize(model: torch.nn.Module) -> None:
    """Every parameter drawn from one seeded generator, at unit-variance activations, norms away
    from 1 and 0 and every bias nonzero, so a swapped, skipped or misread tensor cannot pass."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("logit_scale"):
                p.fill_(2.3)
            elif name.endswith("logit_bias"):
                p.fill_(-1.5)
            elif "norm" in name:  # every LayerNorm (layer_norm1, pre_layrnorm, head.layernorm...)
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif name.endswith("bias"):  # Linears, the patch conv, MultiheadAttention's in_proj_bias
                p.copy_(0.1 * noise)
            elif "embedding" in name and p.dim() <= 2 or name.endswith("probe"):  # tables, class token
                p.copy_(noise)
            else:  # Linear, conv and in_proj weights: [out, fan_in...]
                p.copy_(noise * p[0].numel() ** -0.5)


def save_random(model_class, config, directory) -> torch.nn.Module:
    torch.manual_seed(0)
    reference = model_class(config).eval()
    reference.set_attn_implementation("eager")
    randomize(reference)
    reference.save_pretrained(directory)
    return reference


class TinyClip(NamedTuple):
    reference: torch.nn.Module  # transformers' model of the folder's weights
    processor: Any  # transformers' image processor (PIL backend) of the folder's preprocessor_config.json
    tokenizer: Any  # transformers' fast tokenizer of the folder's tokenizer.json, padding with <pad>
    card: dict  # the card's fields: parse_card takes them, and as JSON they are a cards folder's YAML


@dataclass(frozen=True)
class _Kind:
    config: Callable[[int], Any]  # text positions -> transformers config
    model: type
    image_processor: type
    processor_config: dict
    image_tokens: int  # patches (+ CLIP's class token)
    dimensions: int
    frame: str  # the tokenizer's template around a text's words ($A)


_KINDS = {
    "clip": _Kind(
        config=lambda max_text: transformers.CLIPConfig(
            text_config=dict(
                TEXT_SHAPE, max_position_embeddings=max_text, eos_token_id=EOS, bos_token_id=BOS, pad_token_id=PAD
            ),
            vision_config=VISION_SHAPE,
            projection_dim=24,
        ),
        model=transformers.CLIPModel,
        image_processor=transformers.CLIPImageProcessorPil,
        processor_config={
            "image_processor_type": "CLIPImageProcessor",
            "size": {"shortest_edge": IMAGE},
            "crop_size": {"height": IMAGE, "width": IMAGE},
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
        },
        image_tokens=(IMAGE // PATCH) ** 2 + 1,
        dimensions=24,
        frame="<|startoftext|> $A <|endoftext|>",
    ),
    "siglip": _Kind(
        config=lambda max_text: transformers.SiglipConfig(
            text_config=dict(
                TEXT_SHAPE,
                max_position_embeddings=max_text,
                projection_size=48,  # a text head wider than the text tower, to the vision width
                eos_token_id=SIGLIP_EOS,
                pad_token_id=PAD,
            ),
            vision_config=VISION_SHAPE,
        ),
        model=transformers.SiglipModel,
        image_processor=transformers.SiglipImageProcessorPil,
        processor_config={"image_processor_type": "SiglipImageProcessor", "size": {"height": IMAGE, "width": IMAGE}},
        image_tokens=(IMAGE // PATCH) ** 2,
        dimensions=48,
        frame="$A </s>",
    ),
}
_SPECIALS = {"<unk>": 0, "<pad>": PAD, "<|endoftext|>": EOS, "<|startoftext|>": BOS, "</s>": SIGLIP_EOS}


def write_tokenizer(directory: Path, words: Sequence[str], frame: str) -> None:
    """A word-level tokenizer.json of `words` (ids 10, 11, ...) whose special ids are the config's,
    framing a text as `frame` says (CLIP: <|startoftext|> ... <|endoftext|>, SigLIP: ... </s>);
    tokenizer_config.json names <pad> its pad token."""
    tokenizer = Tokenizer(
        models.WordLevel({**_SPECIALS, **{w: 10 + i for i, w in enumerate(words)}}, unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = [(token, _SPECIALS[token]) for token in frame.split() if token != "$A"]
    tokenizer.post_processor = processors.TemplateProcessing(single=frame, special_tokens=specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))


def tiny_clip(
    directory: Path,
    kind: str = "clip",
    *,
    model_id: str,
    words: Sequence[str] = (),
    extract: bool = False,
    max_text: int = MAX_TEXT,
) -> TinyClip:
    """A random-weight CLIP or SigLIP (`kind`) saved in `directory` as a hub folder is: config.json
    and weights, preprocessor_config.json, tokenizer.json of `words`; with the card that serves it
    as `model_id`. `extract`: the card also labels images (extract kind image_labels, TEMPLATE);
    `max_text`: the text positions, and the card's max_length."""
    shape = _KINDS[kind]
    reference = save_random(shape.model, shape.config(max_text), directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(shape.processor_config))
    write_tokenizer(directory, words, shape.frame)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), pad_token="<pad>"
    )
    card = {
        "id": model_id,
        "architecture": kind,
        "source": {"path": str(directory)},
        "max_length": max_text,
        "modalities": ["text", "image"],
        "image_tokens": shape.image_tokens,
        "pooling": "model",
        "dimensions": shape.dimensions,
        "outputs": ["dense"],
        "tasks": ["encode", "score", "extract"] if extract else ["encode", "score"],
    }
    if extract:
        card["extract"] = {"kind": "image_labels", "hypothesis_template": TEMPLATE}
    return TinyClip(reference, shape.image_processor(**shape.processor_config), tokenizer, card)
