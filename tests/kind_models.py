"""One random-weight model per extract kind, saved to a folder as its library saves it, with the
card that serves it as `test/kind-<kind>` (shared by the bench and batch CLI tests of every kind).

Built as the kind's own tests build them (extract_models.py, test_classify.py, test_gliclass.py,
test_gliner2.py, test_glirel.py, vision_models.py), once per session: a kind's folder under the
session's base temp directory is reused when its card is there. A kind whose reference package is
missing (gliner, gliclass, gliner2, glirel) is left out.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

KINDS = ("gliner", "token_class", "zero_shot", "classify", "gliclass", "gliner2", "glirel", "image_labels")
# The package each kind's random model is built with, where one beyond transformers is needed.
_NEEDS = {"gliner": "gliner", "gliclass": "gliclass", "gliner2": "gliner2", "glirel": "glirel"}
SENTIMENT = ["negative", "neutral", "positive"]


def model_id(kind: str) -> str:
    return f"test/kind-{kind}"


def cards_dir(tmp_path_factory) -> Path:
    """The cards folder (`<kind>.yaml` each, JSON) of every kind whose package is installed, each
    model built once per session."""
    root = tmp_path_factory.getbasetemp() / "extract-kinds"
    cards = root / "cards"
    cards.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        path = cards / f"{kind}.yaml"
        if path.exists() or (kind in _NEEDS and importlib.util.find_spec(_NEEDS[kind]) is None):
            continue
        card = _build(kind, root / kind)
        path.write_text(json.dumps({**card, "id": model_id(kind)}))  # JSON is YAML
    return cards


def served_kinds(cards: Path) -> set[str]:
    return {path.stem for path in cards.glob("*.yaml")}


def _build(kind: str, directory: Path) -> dict:
    """Build `kind`'s random model in `directory`; its card (the id aside)."""
    directory.mkdir(parents=True, exist_ok=True)
    card: dict = {
        "tasks": ["extract"],
        "extract": {"kind": kind},
        "source": {"path": str(directory)},
        "max_length": 512,
    }
    if kind == "gliner":
        from extract_models import build_gliner

        build_gliner(directory, "deberta-v3", seed=1)
    elif kind == "token_class":
        from extract_models import build_token_classifier

        build_token_classifier(directory, seed=3)
    elif kind == "zero_shot":
        from extract_models import build_nli

        build_nli(directory, ["contradiction", "entailment", "neutral"], seed=4)
    elif kind == "classify":
        import torch

        from extract_models import spread, wordpiece_tokenizer
        from test_classify import _bert

        torch.manual_seed(1)
        model = _bert(wordpiece_tokenizer(directory), SENTIMENT).eval()
        spread(model, 5)
        model.save_pretrained(directory)
        card["max_length"] = 128
    elif kind == "gliclass":
        from test_gliclass import build_gliclass

        build_gliclass(directory / "model", seed=1, scorer_type="weighted-dot")
        card["source"] = {"path": str(directory / "model")}
    elif kind == "gliner2":
        from test_gliner2 import build_gliner2

        build_gliner2(directory / "model", seed=3, counting_layer="count_lstm_v2")
        card["source"] = {"path": str(directory / "model")}
    elif kind == "glirel":
        from test_glirel import build_glirel

        build_glirel(directory / "model", seed=3)  # its backbone beside it, in model-backbone
        card["source"] = {"path": str(directory / "model")}
        card["extract"]["backbone"] = {"path": str(directory / "model-backbone")}
    else:  # image_labels
        from vision_models import tiny_clip

        card = tiny_clip(directory, model_id=model_id(kind), words=["cat", "dog", "photo"], extract=True).card
    return card
