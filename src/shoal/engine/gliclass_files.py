"""A GLiClass folder -> its backbone (a shoal encoder) and tokenizer.

`GLiClassModel.save_pretrained` writes config.json (`model_type: GLiClass`, the backbone's config
inside it as `encoder_config`) and one checkpoint: the backbone under `model.encoder_model.`, its
token embeddings resized for the added <<LABEL>> and <<SEP>> tokens, GLiClass's projectors and
scorer beside it (read by `heads.gliclass`). The tokenizer with those tokens is saved beside it.
"""

from __future__ import annotations

from pathlib import Path

from ..catalog.card import ModelCard
from ..errors import ModelLoadError
from ..heads.gliclass import (
    BACKBONE_PREFIX,
    CONFIG_FILE,
    LABEL_TOKEN,
    SEP_TOKEN,
    check_gliclass_config,
    read_gliclass_config,
)
from ..weights import build_model, tensor_shape
from .tokenizer import TextTokenizer
from .tokenizer_files import load_tokenizer

# The backbone's token embeddings: BERT/DeBERTa, ModernBERT.
_EMBEDDINGS = ("embeddings.word_embeddings.weight", "embeddings.tok_embeddings.weight")


def load_gliclass_backbone(card: ModelCard, directory: Path, device: str, allow_download: bool = True):
    config = read_gliclass_config(directory)
    check_gliclass_config(config, str(directory))
    encoder = dict(config["encoder_config"])
    rows = tensor_shape(directory, tuple(BACKBONE_PREFIX + name for name in _EMBEDDINGS))
    if rows is None:
        raise ModelLoadError(
            f"{directory}: the checkpoint has no {BACKBONE_PREFIX}embeddings.word_embeddings.weight "
            "(or its ModernBERT name); is this a GLiClass checkpoint?",
            details={"file": CONFIG_FILE},
        )
    encoder["vocab_size"] = rows[0]  # resized for GLiClass's added tokens
    model = build_model(
        directory,
        card.architecture or encoder.get("model_type"),
        device,
        card.dtype,
        config=encoder,
        prefixes=(BACKBONE_PREFIX,),
    )
    if not (directory / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"{directory}: no tokenizer.json; GLiClass checkpoints ship their tokenizer (with the "
            f"{LABEL_TOKEN} and {SEP_TOKEN} tokens) beside the weights",
            details={"file": "tokenizer.json"},
        )
    tokenizer = load_tokenizer(directory)
    for token, field in ((LABEL_TOKEN, "class_token_index"), (SEP_TOKEN, None)):
        token_id = tokenizer.token_to_id(token)
        if token_id is None or token_id >= rows[0]:
            raise ModelLoadError(
                f"{directory}: GLiClass's {token!r} is not in the tokenizer (or past the checkpoint's "
                f"{rows[0]} embeddings)",
                details={"file": "tokenizer.json"},
            )
        if field is not None and config.get(field, token_id) not in (-1, token_id):
            raise ModelLoadError(
                f"{directory}: {field} {config[field]} is not the tokenizer's id {token_id} for {token!r}",
                details={"file": CONFIG_FILE, "field": field},
            )
    max_length = min(card.max_length, getattr(model, "max_positions", None) or card.max_length)
    return model, TextTokenizer(tokenizer, max_length)
