"""A GLiREL folder -> its backbone (a shoal encoder) and tokenizer.

GLiREL's `save_pretrained` writes `glirel_config.json` and `pytorch_model.bin`: the backbone under
`token_rep_layer.bert_layer.model.` (its embeddings resized for GLiREL's tokens), GLiREL's own
layers beside it (read by `heads.glirel`). The folder holds neither the backbone's config nor a
tokenizer, only the backbone's name (`model_name`), so the card names where the backbone's
config.json and tokenizer are (`extract.backbone`); GLiREL's tokens are added to that tokenizer as
the glirel package adds them: [FLERT] as a special token when missing, then [REL], [SEP], [E] and
[/E] as plain ones.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken

from ..catalog.card import ModelCard
from ..catalog.resolve import resolve_source
from ..errors import ModelLoadError
from ..heads.glirel import ADDED_TOKENS, BACKBONE_PREFIX, CONFIG_FILE, check_glirel_config, read_glirel_config
from ..weights import build_model, read_config, tensor_shape
from .tokenizer import TextTokenizer
from .tokenizer_files import load_tokenizer

_EMBEDDINGS = (BACKBONE_PREFIX + "embeddings.word_embeddings.weight",)


def load_glirel_backbone(card: ModelCard, directory: Path, device: str, allow_download: bool = True):
    config = read_glirel_config(directory)
    check_glirel_config(config, str(directory))
    backbone_dir = _backbone_dir(card, config, allow_download)
    encoder = dict(read_config(backbone_dir))
    rows = tensor_shape(directory, _EMBEDDINGS)
    if rows is None:
        raise ModelLoadError(
            f"{directory}: the checkpoint has no {_EMBEDDINGS[0]}; is this a GLiREL checkpoint?",
            details={"file": CONFIG_FILE},
        )
    encoder["vocab_size"] = rows[0]  # resized for GLiREL's added tokens
    model = build_model(
        directory,
        card.architecture or encoder.get("model_type"),
        device,
        card.dtype,
        config=encoder,
        prefixes=(BACKBONE_PREFIX,),
    )
    tokenizer = load_tokenizer(backbone_dir)
    if tokenizer.token_to_id("[FLERT]") is None:
        tokenizer.add_special_tokens([AddedToken("[FLERT]", special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken(token, normalized=True) for token in ADDED_TOKENS])
    for token in ADDED_TOKENS[:2]:  # the prompt's
        token_id = tokenizer.token_to_id(token)
        if token_id is None or token_id >= rows[0]:
            raise ModelLoadError(
                f"{directory}: GLiREL's {token} is not in the backbone's tokenizer with GLiREL's tokens added "
                f"(or past the checkpoint's {rows[0]} embeddings): is extract.backbone the model it was trained on?",
                details={"file": CONFIG_FILE, "token": token},
            )
    max_length = min(card.max_length, getattr(model, "max_positions", None) or card.max_length)
    return model, TextTokenizer(tokenizer, max_length)


def _backbone_dir(card: ModelCard, config: dict, allow_download: bool) -> Path:
    source = card.extract.backbone if card.extract is not None else None
    if source is None:
        raise ModelLoadError(
            f"{card.id}: a GLiREL folder holds no backbone config or tokenizer; the card's extract.backbone "
            f"must say where the backbone ({config.get('model_name', '?')}) config.json and tokenizer are",
            details={"model": card.id, "field": "extract.backbone"},
        )
    return resolve_source(source, f"the backbone of {card.id}", card.card_path, allow_download)
