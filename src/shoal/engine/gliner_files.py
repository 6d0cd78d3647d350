"""A GLiNER folder -> its backbone (a shoal encoder) and tokenizer.

GLiNER saves `gliner_config.json` and one checkpoint: the backbone under
`token_rep_layer.bert_layer.model.`, GLiNER's own layers beside it (read by `heads.gliner`). Newer
saves carry the backbone's config as `encoder_config` and the tokenizer with GLiNER's added tokens;
the published v2.1 checkpoints carry neither, only the backbone's name (`model_name`), so the card
names where its config.json and tokenizer are (`extract.backbone`), and GLiNER's tokens are added
to that tokenizer as the gliner library adds them ([FLERT], then the entity and separator tokens).
"""

from __future__ import annotations

from pathlib import Path

from ..catalog.card import ModelCard
from ..catalog.resolve import resolve_source
from ..errors import ModelLoadError
from ..heads.gliner import BACKBONE_PREFIX, CONFIG_FILE, check_gliner_config, read_gliner_config
from ..weights import build_model, read_config, tensor_shape
from .tokenizer import TextTokenizer
from .tokenizer_files import load_tokenizer


def load_gliner_backbone(card: ModelCard, directory: Path, device: str, allow_download: bool = True):
    config = read_gliner_config(directory)
    check_gliner_config(config, str(directory))
    backbone_dir = None
    encoder = config.get("encoder_config")
    if not encoder:
        backbone_dir = _backbone_dir(card, config, allow_download)
        encoder = read_config(backbone_dir)
    encoder = dict(encoder)
    rows = tensor_shape(directory, tuple(BACKBONE_PREFIX + name for name in _EMBEDDINGS))
    if rows is None:
        raise ModelLoadError(
            f"{directory}: the checkpoint has no {BACKBONE_PREFIX}embeddings.word_embeddings.weight "
            "(or its ModernBERT name); is this a GLiNER checkpoint?",
            details={"file": CONFIG_FILE},
        )
    encoder["vocab_size"] = rows[0]  # resized for GLiNER's added tokens
    model = build_model(
        directory,
        card.architecture or encoder.get("model_type"),
        device,
        card.dtype,
        config=encoder,
        prefixes=(BACKBONE_PREFIX,),
    )

    if (directory / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(directory)
    else:
        backbone_dir = backbone_dir or _backbone_dir(card, config, allow_download)
        tokenizer = load_tokenizer(backbone_dir)
        tokenizer.add_special_tokens(
            ["[FLERT]", config.get("ent_token", "<<ENT>>"), config.get("sep_token", "<<SEP>>")]
        )
    max_length = min(card.max_length, getattr(model, "max_positions", None) or card.max_length)
    for name in ("ent_token", "sep_token"):
        token = config.get(name, "<<ENT>>" if name == "ent_token" else "<<SEP>>")
        token_id = tokenizer.token_to_id(token)
        if token_id is None or token_id >= rows[0]:
            raise ModelLoadError(
                f"{directory}: GLiNER's {name} {token!r} is not in the tokenizer (or past the "
                f"checkpoint's {rows[0]} embeddings)",
                details={"file": CONFIG_FILE, "field": name},
            )
    index = config.get("class_token_index", -1)
    ent_id = tokenizer.token_to_id(config.get("ent_token", "<<ENT>>"))
    if index not in (-1, None) and index != ent_id:
        raise ModelLoadError(
            f"{directory}: class_token_index {index} is not the tokenizer's id {ent_id} for "
            f"{config.get('ent_token', '<<ENT>>')!r}",
            details={"file": CONFIG_FILE},
        )
    return model, TextTokenizer(tokenizer, max_length)


# The backbone's token embeddings (resized for GLiNER's added tokens): BERT/DeBERTa, ModernBERT.
_EMBEDDINGS = ("embeddings.word_embeddings.weight", "embeddings.tok_embeddings.weight")


def _backbone_dir(card: ModelCard, config: dict, allow_download: bool) -> Path:
    source = card.extract.backbone if card.extract is not None else None
    if source is None:
        raise ModelLoadError(
            f"{card.id}: {CONFIG_FILE} has no encoder_config and the folder no tokenizer.json; the card's "
            f"extract.backbone must say where the backbone ({config.get('model_name', '?')}) config and "
            "tokenizer are",
            details={"model": card.id, "field": "extract.backbone"},
        )
    return resolve_source(source, f"the backbone of {card.id}", card.card_path, allow_download)
