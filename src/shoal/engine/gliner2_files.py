"""A GLiNER2 folder -> its backbone (a shoal encoder) and tokenizer.

GLiNER2's `save_pretrained` writes `config.json` (model_type `extractor`), the backbone's config
under `encoder_config/config.json`, one `model.safetensors` (the backbone under `encoder.`, the
span, count and classifier layers beside it, read by `heads.gliner2`) and the backbone's tokenizer
with GLiNER2's schema tokens ([P], [E], [L], [SEP_TEXT], ...) added.
"""

from __future__ import annotations

from pathlib import Path

from ..catalog.card import ModelCard
from ..errors import ModelLoadError
from ..heads.gliner2 import BACKBONE_PREFIX, CONFIG_FILE, check_gliner2_config, read_gliner2_config
from ..weights import build_model, read_config, tensor_shape
from .tokenizer import TextTokenizer
from .tokenizer_files import load_tokenizer

# The tokens a GLiNER2 prompt is built from; the folder's tokenizer must know each.
SCHEMA_TOKENS = ("[SEP_STRUCT]", "[SEP_TEXT]", "[P]", "[C]", "[E]", "[R]", "[L]", "[DESCRIPTION]")


def load_gliner2_backbone(card: ModelCard, directory: Path, device: str, allow_download: bool = True):
    config = read_gliner2_config(directory)
    check_gliner2_config(config, str(directory))
    encoder = dict(read_config(directory / "encoder_config"))
    rows = tensor_shape(directory, (BACKBONE_PREFIX + "embeddings.word_embeddings.weight",))
    if rows is None:
        raise ModelLoadError(
            f"{directory}: the checkpoint has no {BACKBONE_PREFIX}embeddings.word_embeddings.weight; "
            "is this a GLiNER2 checkpoint?",
            details={"file": CONFIG_FILE},
        )
    encoder["vocab_size"] = rows[0]  # resized for GLiNER2's schema tokens
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
            f"{directory}: no tokenizer.json (GLiNER2 saves the backbone's tokenizer with its schema tokens)",
            details={"file": "tokenizer.json"},
        )
    tokenizer = load_tokenizer(directory)
    for token in SCHEMA_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None or token_id >= rows[0]:
            raise ModelLoadError(
                f"{directory}: GLiNER2's schema token {token!r} is not in the tokenizer (or past the "
                f"checkpoint's {rows[0]} embeddings)",
                details={"file": "tokenizer.json", "token": token},
            )
    max_length = min(card.max_length, getattr(model, "max_positions", None) or card.max_length)
    return model, TextTokenizer(tokenizer, max_length)
