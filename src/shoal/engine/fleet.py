"""The fleet of one engine: which models (and adapters) it serves, which are resident, and hot add.

`Fleet` owns the catalog (restricted to `--models`) and the `ModelCache` (engine/cache.py). The
engine asks it for a model (and adapter) per call; operators ask it to load, unload, pin and
unpin; `/v1/models` asks it for statuses. `watch` is the hot-add loop: it checks the models
directories' files every `watch_interval_s` and, when something changed, reloads the catalog off
the event loop and swaps it in: new cards and adapters are served from then on, a changed card's
resident model is dropped once its in-flight work is done (the next request loads the new card),
a removed card stops being served, and a broken file is logged and listed, taking nothing down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import msgspec

from ..catalog import ADAPTERS_DIR, TUNED_DIR, Catalog, ModelCard
from ..catalog.resolve import weights_state
from ..errors import InvalidRequest, ModelLoadError
from ..head_info import ClassLabels
from ..service import ADMIN_ACTIONS, CardProblem, ModelStatus, status_of_card
from .backend import LoadedModel
from .cache import ModelCache

log = logging.getLogger("shoal.fleet")

# A model's weights state other than `local` is looked up again after this long.
WEIGHTS_RECHECK_S = 10.0

# Extract kinds whose backbone sits inside the library's own layout: no LoRA path for them yet.
_NO_ADAPTERS = {"gliner": "GLiNER span", "gliclass": "GLiClass", "gliner2": "GLiNER2", "glirel": "GLiREL"}


class Fleet:
    def __init__(
        self,
        catalog: Catalog,
        cache: ModelCache,
        *,
        device: str,
        models_dirs: tuple[Path, ...] = (),
        watch_interval_s: float | None = None,
        allow_download: bool = False,
    ) -> None:
        self.catalog = catalog
        self.cache = cache
        self._allow_download = allow_download
        # card id -> (the card, when looked, its weights state): `local` stands while the card does.
        self._weights: dict[str, tuple[ModelCard, float, str]] = {}
        self._aliases = dict(catalog.extra_aliases)  # `--alias`: applied again on every reload
        self._device = device
        self._dirs = models_dirs
        self._watch_interval_s = watch_interval_s
        self._fingerprint = _fingerprint(models_dirs, tuple(f for c in catalog for f in c.adapter_dirs().values()))
        self._watcher: asyncio.Task | None = None
        for problem in self.problems():
            log.error("not serving %s: %s", problem.file, problem.error)
        self._card_pins: set[str] = set()  # pins that came from cards (a reload may take them back)
        for card in catalog:
            if card.pin:
                self._pin_from_card(card.id)

    def _pin_from_card(self, model_id: str) -> None:
        if not self.cache.is_pinned(model_id):
            self._card_pins.add(model_id)
            self.cache.pin(model_id)

    def _unpin_from_card(self, model_id: str) -> None:
        if model_id in self._card_pins:  # a pin from the settings or an operator stays
            self._card_pins.discard(model_id)
            self.cache.unpin(model_id)

    @property
    def preload_ids(self) -> list[str]:
        """Cards that ask to be loaded before serving."""
        return [card.id for card in self.catalog if card.preload]

    # --- per call -------------------------------------------------------------------------------

    async def acquire(self, card: ModelCard, adapter: str | None) -> tuple[LoadedModel, int]:
        """(runner, adapter slot or -1), both counted in flight until `release`."""
        directory = None
        if adapter is not None:
            if card.extract is not None and card.extract.kind in _NO_ADAPTERS:
                raise InvalidRequest(
                    f"model {card.id} is a {_NO_ADAPTERS[card.extract.kind]} model: LoRA adapters are not "
                    "supported for those yet",
                    details={"model": card.id, "adapter": adapter},
                )
            directory = card.adapter_dirs().get(adapter)
            if directory is None:
                have = ", ".join(sorted(card.adapters)) or "none"
                raise InvalidRequest(
                    f"model {card.id} has no adapter {adapter!r} (its adapters: {have}; "
                    f"GET /v1/models/{card.id} lists them)",
                    details={"model": card.id, "adapter": adapter, "adapters": sorted(card.adapters)},
                )
        try:
            runner = await self.cache.acquire(card)
        except ModelLoadError as exc:
            if exc.details.get("weights") != "unavailable":
                raise
            servable = [c.id for c in self.catalog if c.id != card.id and self.weights(c) == "local"]
            raise ModelLoadError(
                f"{exc.message}; models with their weights on this server: {', '.join(servable) or 'none'} "
                "(GET /v1/models: `weights`)",
                details={**exc.details, "servable": servable},
                permanent=exc.permanent,
                retry_after_s=exc.retry_after_s,
            ) from None
        if directory is None:
            return runner, -1
        assert adapter is not None  # its folder was found above
        try:
            return runner, await self.cache.acquire_adapter(card.id, runner, adapter, directory)
        except BaseException:
            self.cache.release(card.id)
            raise

    def release(self, model_id: str, adapter: str | None) -> None:
        if adapter is not None:
            self.cache.release_adapter(model_id, adapter)
        self.cache.release(model_id)

    # --- statuses and operators -----------------------------------------------------------------

    def statuses(self) -> list[ModelStatus]:
        return [self.status(card) for card in self.catalog]

    def weights(self, card: ModelCard) -> str:
        """Where the card's weights are (`resolve.weights_state`): looked up again after
        WEIGHTS_RECHECK_S unless `local`, and whenever the card changes."""
        known = self._weights.get(card.id)
        now = time.monotonic()
        if known is not None and known[0] is card and (known[2] == "local" or now - known[1] < WEIGHTS_RECHECK_S):
            return known[2]
        state = "local" if self.cache.is_loaded(card.id) else weights_state(card, self._allow_download)
        self._weights[card.id] = (card, now, state)
        return state

    def status(self, card: ModelCard) -> ModelStatus:
        cache = self.cache
        failure = cache.failure(card.id)
        runner = cache.runner(card.id)
        loaded = runner is not None
        state = (
            "loaded"
            if loaded
            else "loading"
            if cache.is_loading(card.id)
            else "failed"
            if failure is not None
            else "not_loaded"
        )
        return status_of_card(
            card,
            loaded=loaded,
            state=state,
            bytes=cache.model_bytes(card.id) if loaded else None,
            pinned=cache.is_pinned(card.id),
            device=self._device,
            adapters_loaded=cache.adapters_of(card.id),
            aliases=self.catalog.aliases_of(card.id),
            error=failure.message if failure is not None and not loaded else None,
            weights=self.weights(card),
            labels=_class_labels(runner),
        )

    def problems(self) -> list[CardProblem]:
        return [
            CardProblem(file=os.path.basename(file.rstrip("/")), error=_public(error))
            for file, error in sorted(self.catalog.broken.items())
        ]

    async def warm(self, model_ids: list[str]) -> None:
        """Load these models, then the cards that ask for it, waiting as long as each load takes."""
        for model_id in dict.fromkeys([*model_ids, *self.preload_ids]):
            card = self.catalog.get(model_id)
            await self.cache.acquire(card, patient=True)
            self.cache.release(card.id)

    async def admin(self, model_id: str, action: str) -> ModelStatus:
        if action not in ADMIN_ACTIONS:
            raise InvalidRequest(f"unknown model action {action!r}: use one of {', '.join(ADMIN_ACTIONS)}")
        card = self.catalog.get(model_id)
        if action == "load":
            await self.cache.acquire(card)
            self.cache.release(card.id)
        elif action == "unload":
            self.cache.unload(card.id)
        elif action == "pin":
            self.cache.pin(card.id)
        else:
            self.cache.unpin(card.id)
        log.info("admin: %s %s", action, card.id)
        return self.status(card)

    # --- hot add --------------------------------------------------------------------------------

    def start(self) -> None:
        if self._watch_interval_s and self._dirs and self._watcher is None:
            self._watcher = asyncio.create_task(self.watch(self._watch_interval_s), name="shoal-watch-models")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            try:
                await self._watcher
            except asyncio.CancelledError:
                pass
            self._watcher = None

    async def watch(self, interval_s: float) -> None:
        """Check the models directories every `interval_s`; reload the catalog when they changed."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except Exception:  # a reload that fails keeps the catalog that works
                log.exception("reloading the model cards failed; still serving the previous ones")

    async def refresh(self) -> bool:
        """Reload the catalog if the directories' files changed since the last look; True if so."""
        declared = tuple(folder for card in self.catalog for folder in card.adapter_dirs().values())
        fingerprint = await asyncio.to_thread(_fingerprint, self._dirs, declared)
        if fingerprint == self._fingerprint:
            return False
        changed_files = {entry[0] for entry in set(fingerprint) ^ set(self._fingerprint)}
        catalog = await asyncio.to_thread(self._reload)
        self._swap(catalog, changed_files)
        self._fingerprint = fingerprint  # only now: a reload that failed is tried again
        return True

    def _reload(self) -> Catalog:
        new = Catalog.load(self._dirs, strict=False).restrict(self.catalog.patterns, strict=False)
        return new.with_aliases({a: m for a, m in self._aliases.items() if m in new})

    def _swap(self, new: Catalog, changed_files: set[str]) -> None:
        old = self.catalog
        old_ids = {card.id for card in old}
        changed_dirs = {Path(f).parent for f in changed_files}
        for card in new:
            if card.id not in old_ids:
                log.info("serving new model %s (from %s)", card.id, card.card_path)
                if card.pin:
                    self._pin_from_card(card.id)
                continue
            before = old.get(card.id)
            if _what_loads(before) != _what_loads(card):
                log.info("the card of %s changed: it reloads once its work in flight is done", card.id)
                self.cache.invalidate(card.id)
            if card.pin and not before.pin:
                self._pin_from_card(card.id)
            elif before.pin and not card.pin:
                self._unpin_from_card(card.id)
            old_dirs = before.adapter_dirs()
            for name, folder in card.adapter_dirs().items():
                if name not in old_dirs:
                    log.info("serving new adapter %s of %s", name, card.id)
                elif old_dirs[name].resolve() != folder.resolve() or folder.resolve() in changed_dirs:
                    log.info("adapter %s of %s changed: it reloads once its work in flight is done", name, card.id)
                    self.cache.invalidate_adapter(card.id, name)
            for name in sorted(set(old_dirs) - set(card.adapters)):
                log.info("adapter %s of %s is no longer served", name, card.id)
                self.cache.invalidate_adapter(card.id, name)
        for card_id in sorted(old_ids - {card.id for card in new}):
            log.info("model %s is no longer served (its card is gone)", card_id)
            self._unpin_from_card(card_id)
            self.cache.invalidate(card_id)
        for file, error in new.broken.items():
            if old.broken.get(file) != error:
                log.error("not serving %s: %s", file, error)
        self.catalog = new


def _what_loads(card: ModelCard) -> ModelCard:
    """The card less what does not change the loaded model (its adapters, pin and preload)."""
    return msgspec.structs.replace(card, adapters={}, pin=False, preload=False)


def _public(error: str) -> str:
    """A card error without the server's directories (the log has them)."""
    return ModelLoadError(error).public_message


def _fingerprint(dirs: tuple[Path, ...], adapter_dirs: tuple[Path, ...] = ()) -> tuple:
    """(resolved path, mtime, size) of every card, overlay and adapter file under `dirs`, and of the
    files of the adapter folders cards declare elsewhere: what hot add watches."""
    candidates: list[Path] = []
    for directory in dirs:
        candidates += directory.glob("*.y*ml")
        candidates += (directory / TUNED_DIR).glob("*.y*ml")  # tuned overlays (shoal tune)
        adapters = directory / ADAPTERS_DIR
        if adapters.is_dir():
            candidates += adapters.glob("*/*")
    for folder in adapter_dirs:
        candidates += folder.glob("*")
    entries = set()
    for path in candidates:
        try:
            stat = path.stat()
        except OSError:
            continue
        if path.is_file():  # its folder resolved, not the file: a symlinked file stays in its folder
            entries.add((str(path.parent.resolve() / path.name), stat.st_mtime_ns, stat.st_size))
    return tuple(sorted(entries))


def _class_labels(runner: LoadedModel | None) -> tuple[str, ...]:
    """A loaded text classifier's labels by logit index; () for any other model, or none loaded."""
    heads = runner.info.heads if runner is not None else ()
    return next((info.names for info in heads if isinstance(info, ClassLabels)), ())
