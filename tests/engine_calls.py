"""Run calls on a fresh in-process engine over a catalog with extra cards (shared by the score and
extract tests)."""

from __future__ import annotations

import asyncio

from shoal.catalog import Catalog
from shoal.config import EngineSettings
from shoal.engine import Engine


def run(
    catalog: Catalog,
    *calls,
    catch: tuple[type[BaseException], ...] = (),
    settings: EngineSettings | None = None,
):
    """Each call's result in order, on one engine started for them; an exception of a `catch`
    type is returned in its call's place instead of raised."""

    async def go():
        engine = Engine(settings or EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            out = []
            for call in calls:
                try:
                    out.append(await engine.run(call))
                except catch as exc:
                    out.append(exc)
            return out
        finally:
            await engine.stop()

    return asyncio.run(go())


def catalog_with(tmp_path, *cards: str) -> Catalog:
    """The built-in catalog plus each YAML card text, written under `tmp_path/cards`."""
    directory = tmp_path / "cards"
    directory.mkdir(exist_ok=True)
    for i, card in enumerate(cards):
        (directory / f"card{i}.yaml").write_text(card)
    return Catalog.load(extra_dirs=(directory,))
