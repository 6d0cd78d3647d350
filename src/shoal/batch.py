"""`shoal encode|score|extract` over files: read texts, run them through a server (`--url`, the SDK)
or an in-process engine, write results, show progress and one summary line.

Inputs: `.txt` (one text per line), `.jsonl` (one object per line with a `text` field — `--field`
names another — and an optional `id`), `.parquet` (a `text` column, or `--field`, and `id` if
present); for `encode`, `--images DIR` instead: every image file in DIR and its subfolders
(`image_files`), sorted by its path under DIR, which names its row (`{"image": "cats/01.png"}`).
Outputs: `.jsonl` (one object per input, its `id` kept), `.npy` (encode: the dense vectors as one
`[n, d]` array, in input order), `.parquet` (a row per input). A malformed input names the file and
the line. Both the SDK path and the in-process path send chunks of `--batch-size` inputs,
`--concurrency` at once, and keep the input order.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .errors import ConfigError, InvalidRequest

READ_SUFFIXES = (".txt", ".jsonl", ".parquet")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")  # any case
WRITE_SUFFIXES = {
    "encode": (".jsonl", ".npy", ".parquet"),
    "score": (".jsonl", ".parquet"),
    "extract": (".jsonl", ".parquet"),
}


T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Record:
    text: str
    id: Any = None


@dataclass
class ImageFile:
    name: str  # its path under the --images folder, with '/': the row's `image`
    path: Path


# --- reading ------------------------------------------------------------------------------------


def read(path: Path, field: str = "text") -> list[Record]:
    if path.suffix not in READ_SUFFIXES:
        raise ConfigError(f"{path}: read .txt (a text a line), .jsonl or .parquet, not {path.suffix or 'no suffix'}")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    if path.suffix == ".txt":
        return [Record(line) for line in _lines(path) if line.strip()]
    if path.suffix == ".jsonl":
        return list(_jsonl(path, field))
    return _parquet(path, field)


def image_files(directory: Path) -> list[ImageFile]:
    """Every image file (IMAGE_SUFFIXES) in `directory` and its subfolders, hidden ones skipped,
    sorted by its path under `directory`; none is a ConfigError."""
    if not directory.is_dir():
        raise ConfigError(f"{directory}: no such folder (--images takes a folder of image files)")
    names = sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.suffix.lower() in IMAGE_SUFFIXES
        and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    )
    if not names:
        raise ConfigError(f"{directory}: no image files ({', '.join(IMAGE_SUFFIXES)}) in it or its subfolders")
    return [ImageFile(name, directory / name) for name in names]


def _lines(path: Path) -> Iterator[str]:
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                yield line.rstrip("\n")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _jsonl(path: Path, field: str) -> Iterator[Record]:
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise ConfigError(
                f"{path}:{number}: each line must be an object with a string {field!r} field"
                + (" (pick another with --field)" if isinstance(obj, dict) else "")
            )
        yield Record(obj[field], obj.get("id"))


def _parquet(path: Path, field: str) -> list[Record]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if field not in table.column_names:
        raise ConfigError(
            f"{path}: no column {field!r} (its columns: {', '.join(table.column_names)}); pick one with --field"
        )
    texts = table.column(field).to_pylist()
    ids = table.column("id").to_pylist() if "id" in table.column_names else [None] * len(texts)
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(f"{path}: row {row}: {field!r} is {type(text).__name__}, not a string")
    return [Record(t, i) for t, i in zip(texts, ids)]


# --- writing ------------------------------------------------------------------------------------


def write(path: Path, verb: str, rows: list[dict], dense: np.ndarray | None = None) -> None:
    if path.suffix == ".npy":
        if dense is None:
            raise ConfigError(f"{path}: .npy holds dense vectors only")
        np.save(path, dense)
        return
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        return
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def check_output(path: Path | None, verb: str) -> None:
    if path is not None and path.suffix not in WRITE_SUFFIXES[verb]:
        raise ConfigError(f"{path}: {verb} writes {', '.join(WRITE_SUFFIXES[verb])}, not {path.suffix or 'no suffix'}")


# --- running ------------------------------------------------------------------------------------


async def in_chunks(
    inputs: Sequence[T],
    batch_size: int,
    concurrency: int,
    run: Callable[[list[T]], Awaitable[R]],
    progress: bool,
    unit: str = "text",
) -> list[R]:
    """`run` on chunks of `batch_size` inputs (texts, image paths), `concurrency` at once; results
    in input order."""
    chunks = [list(inputs[i : i + batch_size]) for i in range(0, len(inputs), batch_size)]
    results: list[Any] = [None] * len(chunks)
    gate = asyncio.Semaphore(concurrency)
    bar = _bar(len(inputs), progress, unit)

    async def one(index: int) -> None:
        async with gate:
            results[index] = await run(chunks[index])
        if bar is not None:
            bar.update(len(chunks[index]))

    try:
        await asyncio.gather(*(one(i) for i in range(len(chunks))))
    finally:
        if bar is not None:
            bar.close()
    return results


def _bar(total: int, enabled: bool, unit: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit=unit, file=sys.stderr)


def summary(verb: str, num_items: int, num_tokens: int, seconds: float) -> str:
    rate = f", {num_tokens / seconds:,.0f} tokens/s" if seconds > 0 and num_tokens else ""
    return f"shoal {verb}: {num_items} items, {num_tokens} tokens in {seconds:.2f} s{rate}"


def records_of(texts: list[str], input_path: Path | None, field: str) -> list[Record]:
    records = [Record(t) for t in texts]
    if input_path is not None:
        records += read(input_path, field)
    if not records:
        raise InvalidRequest("no texts: give them as arguments or with --input FILE")
    return records


class Timer:
    def __enter__(self) -> Timer:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.started
