"""The catalog: model cards by id, from the built-in cards and any directories the user adds.

Tuned overlays (`shoal tune`'s output: batch limits measured for one model on one hardware class)
are read from the package's `tuned/` folder, then from each user directory's `tuned/` folder, and
laid over their cards' `batching` (a later one wins, field by field).

A user's directory may also hold an `adapters/` folder of PEFT LoRA adapters (one folder each,
with `adapter_config.json`); each is added to the card its `base_model_name_or_path` names, under
its folder's name. A card or adapter that cannot be read does not stop the others: it is listed
in `broken` (file -> what is wrong) for the log and `/v1/models`. Built-in cards must all parse.
"""

from __future__ import annotations

import fnmatch
import json
from importlib import resources
from pathlib import Path

import msgspec

from ..errors import CardError, ConfigError, UnknownModel
from .card import ModelCard, Tuned, load_card, load_tuned, parse_card
from .resolve import needs_download, resolve_weights

__all__ = [
    "Catalog",
    "ModelCard",
    "Tuned",
    "load_card",
    "load_tuned",
    "needs_download",
    "parse_card",
    "resolve_weights",
]

ADAPTERS_DIR = "adapters"
TUNED_DIR = "tuned"


class Catalog:
    """Cards by model id. Later directories override earlier ones (a user may re-card a model)."""

    def __init__(
        self,
        cards: list[ModelCard],
        broken: dict[str, str] | None = None,
        patterns: tuple[str, ...] = (),
        *,
        strict: bool = True,
    ) -> None:
        self._cards: dict[str, ModelCard] = {}
        for card in cards:
            self._cards[card.id] = card
        self.broken: dict[str, str] = dict(broken or {})
        self.patterns = patterns  # `--models`: the ids (or globs) this server serves; () all
        self.extra_aliases: dict[str, str] = {}  # `--alias NAME=MODEL`
        self._aliases: dict[str, str] = {}  # alias -> model id
        self._strict = strict
        self._index_aliases()

    def _index_aliases(self) -> None:
        """Index the cards' and `--alias` aliases. A clash is a CardError when strict; otherwise the
        clashing alias is left out and recorded in `broken` under its card's file."""
        self._aliases = {}
        named = [(alias, card.id) for card in self._cards.values() for alias in card.aliases]
        for alias, model_id in named + list(self.extra_aliases.items()):
            problem = None
            if alias in self._cards and alias != model_id:
                problem = f"alias {alias!r} of {model_id} is already a model id; pick another name"
            elif self._aliases.get(alias, model_id) != model_id:
                problem = f"alias {alias!r} names both {self._aliases[alias]} and {model_id}"
            if problem is None:
                self._aliases[alias] = model_id
            elif self._strict:
                raise CardError(problem)
            else:
                self.broken[self._cards[model_id].card_path or model_id] = problem

    def with_aliases(self, aliases: dict[str, str]) -> Catalog:
        """This catalog with `--alias NAME=MODEL` names added (each MODEL must be a served id)."""
        for alias, model_id in aliases.items():
            if model_id not in self._cards:
                raise ConfigError(f"--alias {alias}={model_id}: no served model has that id")
        self.extra_aliases = {**self.extra_aliases, **aliases}
        self._index_aliases()
        return self

    def aliases_of(self, model_id: str) -> tuple[str, ...]:
        return tuple(sorted(alias for alias, target in self._aliases.items() if target == model_id))

    @classmethod
    def load(cls, extra_dirs: tuple[Path, ...] = (), include_builtin: bool = True, *, strict: bool = True) -> Catalog:
        """The built-in cards and those in `extra_dirs`. `strict`: a broken user card raises
        CardError; otherwise it is recorded in `broken` and skipped."""
        cards: list[ModelCard] = []
        broken: dict[str, str] = {}
        if include_builtin:
            builtin = resources.files(__package__) / "cards"
            cards += [
                load_card(Path(str(p)))
                for p in sorted(builtin.iterdir(), key=lambda p: p.name)
                if p.name.endswith((".yaml", ".yml"))
            ]
        for directory in extra_dirs:
            if not directory.is_dir():
                raise CardError(f"{directory}: models directory does not exist")
            for path in sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml")):
                try:
                    cards.append(load_card(path))
                except CardError as exc:
                    if strict:
                        raise
                    broken[str(path)] = exc.message
        catalog = cls(cards, broken, strict=strict)
        if include_builtin:
            catalog._add_tuned(Path(str(resources.files(__package__) / TUNED_DIR)), True)
        for directory in extra_dirs:
            catalog._add_tuned(directory / TUNED_DIR, strict)
            catalog._add_adapters(directory / ADAPTERS_DIR, strict)
        return catalog

    def _add_tuned(self, directory: Path, strict: bool) -> None:
        if not directory.is_dir():
            return
        for path in sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml")):
            try:
                tuned = load_tuned(path)
                if tuned.model not in self._cards:
                    raise CardError(f"{path}: tuned overlay for {tuned.model!r}, which no card serves")
                card, quantize = self._cards[tuned.model], tuned.batching.quantize
                if quantize in ("int8", "int4") and card.dtype != "float32":
                    raise CardError(
                        f"{path}: `quantize` {quantize} runs with float32 activations, and the card of "
                        f"{tuned.model!r} has dtype {card.dtype}: drop quantize from the overlay",
                        details={"file": str(path), "field": "quantize"},
                    )
                if quantize == "int4" and card.generate is None:
                    raise CardError(
                        f"{path}: `quantize` int4 is for generating cards, and {tuned.model!r} does not "
                        "generate: use int8 or drop quantize from the overlay",
                        details={"file": str(path), "field": "quantize"},
                    )
            except CardError as exc:
                if strict:
                    raise
                self.broken[str(path)] = exc.message
                continue
            self._cards[tuned.model] = self._cards[tuned.model].with_tuned(tuned)

    def _add_adapters(self, directory: Path, strict: bool) -> None:
        if not directory.is_dir():
            return
        for folder in sorted(p for p in directory.iterdir() if p.is_dir()):
            try:
                base = _adapter_base(folder)
                card = self._cards.get(base) or next((c for c in self._cards.values() if c.source.hub == base), None)
                if card is None:
                    raise CardError(
                        f"{folder}: adapter for {base!r}, which no card serves "
                        "(set base_model_name_or_path in adapter_config.json to a model id)"
                    )
            except CardError as exc:
                if strict:
                    raise
                self.broken[str(folder)] = exc.message
                continue
            adapters = {**card.adapters, folder.name: str(folder.resolve())}
            self._cards[card.id] = msgspec.structs.replace(card, adapters=adapters)

    def restrict(self, patterns: tuple[str, ...], *, strict: bool = True) -> Catalog:
        """Only the cards whose id matches one of `patterns` (ids or globs); () keeps all.
        `strict`: a pattern that matches no card is a ConfigError (a typo in `--models`)."""
        if not patterns:
            return self
        if strict:
            for pattern in patterns:
                if not any(fnmatch.fnmatchcase(card_id, pattern) for card_id in self._cards):
                    raise ConfigError(f"--models {pattern!r} matches no model card (`shoal models` lists them)")
        kept = [c for c in self._cards.values() if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]
        restricted = Catalog(kept, self.broken, patterns, strict=self._strict)
        return restricted.with_aliases({a: m for a, m in self.extra_aliases.items() if m in restricted})

    def get(self, model_id: str) -> ModelCard:
        """The card of a model id or alias."""
        try:
            return self._cards[self._aliases.get(model_id, model_id)]
        except KeyError:
            raise UnknownModel.named(model_id, self._cards) from None

    def __iter__(self):
        return iter(self._cards.values())

    def __len__(self) -> int:
        return len(self._cards)

    def find(self, model_id: str) -> ModelCard | None:
        """The card `model_id` names (an id or an alias), or None."""
        return self.get(model_id) if model_id in self else None

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._cards or model_id in self._aliases


def _adapter_base(folder: Path) -> str:
    """The base model an adapter folder names (`base_model_name_or_path`)."""
    path = folder / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CardError(f"{path}: cannot read the adapter's config: {exc}", details={"file": str(path)}) from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise CardError(f"{path}: `base_model_name_or_path` must name the base model's id", details={"file": str(path)})
    return base
