"""The catalog: model cards by id, from the built-in cards and any directories the user adds."""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

from ..errors import CardError, UnknownModel
from .card import ModelCard, load_card, parse_card
from .resolve import resolve_weights

__all__ = ["Catalog", "ModelCard", "load_card", "parse_card", "resolve_weights"]


class Catalog:
    """Cards by model id. Later directories override earlier ones (a user may re-card a model)."""

    def __init__(self, cards: list[ModelCard]) -> None:
        self._cards: dict[str, ModelCard] = {}
        for card in cards:
            self._cards[card.id] = card

    @classmethod
    def load(cls, extra_dirs: tuple[Path, ...] = (), include_builtin: bool = True) -> "Catalog":
        paths: list[Path] = []
        if include_builtin:
            builtin = resources.files(__package__) / "cards"
            paths += sorted(Path(str(p)) for p in builtin.iterdir() if p.name.endswith((".yaml", ".yml")))
        for directory in extra_dirs:
            if not directory.is_dir():
                raise CardError(f"{directory}: models directory does not exist")
            paths += sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml"))
        return cls([load_card(p) for p in paths])

    def get(self, model_id: str) -> ModelCard:
        try:
            return self._cards[model_id]
        except KeyError:
            shown = model_id if len(model_id) <= 200 else model_id[:200] + "…"
            close = difflib.get_close_matches(model_id[:200], list(self._cards), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UnknownModel(
                f"unknown model {shown!r}{hint} (GET /v1/models lists the models this server has)",
                details={"model": shown, **({"suggestions": close} if close else {})},
            ) from None

    def __iter__(self):
        return iter(self._cards.values())

    def __len__(self) -> int:
        return len(self._cards)

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._cards
