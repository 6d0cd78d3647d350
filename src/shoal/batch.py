"""`shoal encode|score|extract` over files: read texts, run them through a server (`--url`, the SDK)
or an in-process engine, write results, show progress and one summary line.

Inputs: `.txt` (one text per line, every line a row: a blank line is the empty text, so row i is
line i + 1), `.jsonl` (one object per line with a `text` field — `--field` names another — and an
optional `id`; blank lines hold no object and are skipped), `.parquet` (a `text` column, or
`--field`, and `id` if present; for a glirel model, `entities` too: each row's part of the
call's schema, `row_schemas`); for `encode` (and `extract` on an image_labels model), `--images
DIR` instead: every image file in DIR and its subfolders (`image_files`), sorted by its path under
DIR, which names its row (`{"image": "cats/01.png"}`). Outputs: `.jsonl` (one object per input, its
`id` kept), `.npy` (encode: the dense vectors as one `[n, d]` array in the output dtype, in input
order), `.parquet` (a row per input; `dense` a fixed-size list in the output dtype, `sparse` a
struct of `indices` int32 and `values` float32 lists; extract: each item's fields,
`extracted_row`). A malformed input names the file and the line; an output path the run could not
write is refused before the run (`check_output`). Both the SDK path and the in-process path send
chunks of `--batch-size` inputs, `--concurrency` at once, and keep the input order.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .errors import ConfigError, InvalidRequest

if TYPE_CHECKING:
    from .calls import ExtractedItem

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
    entities: Any = None  # a .jsonl or .parquet row's `entities` (a glirel model's, `row_schemas`)


@dataclass
class ImageFile:
    name: str  # its path under the --images folder, with '/': the row's `image`
    path: Path


@dataclass
class Vectors:
    """`encode`'s outputs for some inputs, a row per input; an output the model did not send is None."""

    dense: np.ndarray | None  # [n, d] in the output dtype (binary, ubinary: [n, d / 8] packed bits)
    sparse: list[tuple[np.ndarray, np.ndarray]] | None  # per row: (indices [k] int32, values [k] float32)
    num_tokens: int


def vectors(
    model: str, dense: np.ndarray | None, sparse: Sequence[tuple[np.ndarray, np.ndarray]] | None, num_tokens: int
) -> Vectors:
    """One chunk's `Vectors`; a model that sent neither dense nor sparse vectors is a ConfigError."""
    if dense is None and sparse is None:
        raise ConfigError(
            f"{model} sent neither dense nor sparse vectors (a multi-vector model?): shoal encode writes "
            "those two (--outputs); use the SDK or POST /v1/encode for the others"
        )
    return Vectors(dense, None if sparse is None else list(sparse), num_tokens)


def joined(chunks: Sequence[Vectors]) -> Vectors:
    """The chunks' rows in order, as one `Vectors`."""
    dense = [c.dense for c in chunks if c.dense is not None]
    sparse = [row for c in chunks if c.sparse is not None for row in c.sparse]
    return Vectors(
        np.concatenate(dense) if len(dense) == len(chunks) else None,
        sparse if all(c.sparse is not None for c in chunks) else None,
        sum(c.num_tokens for c in chunks),
    )


# --- reading ------------------------------------------------------------------------------------


def read(path: Path, field: str = "text") -> list[Record]:
    if path.suffix not in READ_SUFFIXES:
        raise ConfigError(f"{path}: read .txt (a text a line), .jsonl or .parquet, not {path.suffix or 'no suffix'}")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    if path.suffix == ".txt":
        return [Record(line) for line in _lines(path)]  # a blank line too: rows stay aligned with lines
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
        yield Record(obj[field], obj.get("id"), obj.get("entities"))


def _parquet(path: Path, field: str) -> list[Record]:
    pa, pq = _pyarrow(path, "reading")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: not a readable parquet file ({reason})") from None
    if field not in table.column_names:
        raise ConfigError(
            f"{path}: no column {field!r} (its columns: {', '.join(table.column_names)}); pick one with --field"
        )
    texts = table.column(field).to_pylist()
    ids, entities = (
        table.column(name).to_pylist() if name in table.column_names else [None] * len(texts)
        for name in ("id", "entities")
    )
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(f"{path}: row {row}: {field!r} is {type(text).__name__}, not a string")
    return [Record(t, i, e) for t, i, e in zip(texts, ids, entities)]


def _pyarrow(path: Path, doing: str) -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or a ConfigError that says to install it."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: {doing} .parquet needs pyarrow: pip install pyarrow") from None
    return pa, pq


# --- writing ------------------------------------------------------------------------------------


def check_output(path: Path | None, verb: str, outputs: Sequence[str] = ()) -> None:
    """Refuse, before the run, an output the run could not write: a folder, a suffix `verb` does not
    write, sparse `outputs` into .npy, .parquet without pyarrow, a missing or unwritable folder.
    Writability is tried by opening the file to append (a file that was not there is removed again)."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{path} is a folder: --output names the file to write")
    if path.suffix not in WRITE_SUFFIXES[verb]:
        raise ConfigError(f"{path}: {verb} writes {', '.join(WRITE_SUFFIXES[verb])}, not {path.suffix or 'no suffix'}")
    if path.suffix == ".npy" and "sparse" in outputs:
        raise ConfigError(f"{path}: .npy holds dense vectors only; write sparse ones to .jsonl or .parquet")
    if path.suffix == ".parquet":
        _pyarrow(path, "writing")
    folder = path.parent
    if not folder.exists():
        raise ConfigError(f"{path}: no such folder {folder} (create it first)")
    if not folder.is_dir():
        raise ConfigError(f"{path}: {folder} is not a folder")
    existed = path.exists()
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write ({exc.strerror or exc})") from None
    if not existed:
        path.unlink()


def check_dense(path: Path | None, model: str, got: Vectors) -> None:
    """A .npy output of a model that sends no dense vectors is refused at its first chunk."""
    if path is not None and path.suffix == ".npy" and got.dense is None:
        raise ConfigError(
            f"{path}: .npy holds dense vectors only and {model} sends sparse ones: write .jsonl or .parquet"
        )


def json_rows(rows: list[dict], got: Vectors | None = None) -> Iterator[dict]:
    """`rows` with their vectors, as JSON lines carry them: `dense` a list (floats to 6 decimals,
    ints for int8, binary, ubinary), `sparse` `{"indices": [...], "values": [...]}`."""
    for i, row in enumerate(rows):
        if got is None:
            yield row
            continue
        out = dict(row)
        if got.dense is not None:
            out["dense"] = _listed(got.dense[i])
        if got.sparse is not None:
            indices, values = got.sparse[i]
            out["sparse"] = {"indices": indices.tolist(), "values": _listed(values)}
        yield out


def _listed(vector: np.ndarray) -> list:
    if vector.dtype.kind == "f":
        return np.round(vector.astype(np.float64), 6).tolist()
    return vector.tolist()


def write(path: Path, rows: list[dict], got: Vectors | None = None) -> None:
    """Write the rows (and their vectors) to `path`, as its suffix says; an OSError is one line."""
    try:
        if path.suffix == ".npy":
            if got is None or got.dense is None:
                raise ConfigError(f"{path}: .npy holds dense vectors only")
            np.save(path, got.dense)
        elif path.suffix == ".parquet":
            _write_parquet(path, rows, got)
        else:
            with path.open("w", encoding="utf-8") as f:
                for row in json_rows(rows, got):
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write ({exc.strerror or exc})") from None


def _write_parquet(path: Path, rows: list[dict], got: Vectors | None) -> None:
    """A row per input: its fields, `dense` as a fixed-size list in the output dtype, `sparse` as a
    struct of `indices` (int32) and `values` (float32) lists."""
    pa, pq = _pyarrow(path, "writing")
    try:
        table = pa.Table.from_pylist(rows)
    except pa.ArrowException as exc:  # e.g. ids of mixed types
        raise ConfigError(f"{path}: cannot write these rows to parquet ({exc})") from None
    if got is not None and got.dense is not None:
        dense = pa.FixedSizeListArray.from_arrays(pa.array(got.dense.reshape(-1)), got.dense.shape[1])
        table = table.append_column("dense", dense)
    if got is not None and got.sparse is not None:
        offsets = pa.array(np.cumsum([0, *(len(indices) for indices, _ in got.sparse)]), pa.int32())
        indices = np.concatenate([indices for indices, _ in got.sparse]).astype(np.int32)
        values = np.concatenate([values for _, values in got.sparse]).astype(np.float32)
        sparse = pa.StructArray.from_arrays(
            [pa.ListArray.from_arrays(offsets, pa.array(indices)), pa.ListArray.from_arrays(offsets, pa.array(values))],
            names=["indices", "values"],
        )
        table = table.append_column("sparse", sparse)
    pq.write_table(table, path)


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


def extracted_row(item: ExtractedItem) -> dict:
    """The fields an extracted item carries (entities, labels, a GLiNER2 schema's classifications,
    relations and structures), as a row writes them: scores to 6 decimals, offsets into the text."""

    def span(s) -> dict:
        return {"text": s.text, "score": round(s.score, 6), "start": s.start, "end": s.end}

    def labelled(scores) -> list[dict]:
        return [{"label": s.label, "score": round(s.score, 6)} for s in scores]

    out: dict = {}
    if item.entities is not None:
        out["entities"] = [{"text": e.text, "label": e.label, **span(e)} for e in item.entities]
    if item.labels is not None:
        out["labels"] = labelled(item.labels)
    if item.classifications is not None:
        out["classifications"] = {task: labelled(scores) for task, scores in item.classifications.items()}
    if item.relations is not None:
        out["relations"] = {
            name: [
                {"head": span(r.head), "tail": span(r.tail)} | ({} if r.score is None else {"score": round(r.score, 6)})
                for r in found
            ]
            for name, found in item.relations.items()
        }
    if item.structures is not None:

        def value(v) -> dict:
            chosen = {"text": v.text, "score": round(v.score, 6)}
            return chosen if v.start is None else span(v)

        out["structures"] = {
            name: [
                {
                    f: (None if v is None else [value(x) for x in v] if isinstance(v, list) else value(v))
                    for f, v in r.items()
                }
                for r in records
            ]
            for name, records in item.structures.items()
        }
    return out


# Extract kinds whose schema holds one value per item, and the row field each row's value is read
# from: a glirel model's `schema.entities`, a list of {start, end, label} per text.
ROW_SCHEMA_FIELDS = {"glirel": "entities"}


def row_schemas(records: Sequence[Record], model: str, kind: str | None, schema: dict | None) -> list[dict] | None:
    """Each row's part of the schema (`{"entities": [...]}`) for a model of a kind that reads one per
    item (ROW_SCHEMA_FIELDS); None for the other kinds. A row without it, or --schema beside it, is
    a ConfigError."""
    name = ROW_SCHEMA_FIELDS.get(kind or "")
    if name is None:
        return None
    if schema is not None:
        raise ConfigError(
            f"--schema: {model} (kind {kind}) reads each row's {name} from its {name!r} field, not --schema"
        )
    for number, record in enumerate(records, start=1):
        if not isinstance(record.entities, list):
            which = f"row {number}" + ("" if record.id is None else f" (id {record.id!r})")
            state = "has none" if record.entities is None else f"is {type(record.entities).__name__}, not a list"
            raise ConfigError(
                f"{model} (kind {kind}) reads each row's {name}: {which}'s {name!r} field {state} "
                f"(give a .jsonl or .parquet --input whose rows carry {name!r}: a list of {{start, end, label}})"
            )
    return [{name: record.entities} for record in records]


def read_schema(value: str | None) -> dict | None:
    """`--schema`: inline JSON (an object) or the path of a JSON file holding one."""
    if value is None:
        return None
    inline = value.lstrip()[:1] in ("{", "[")  # JSON; anything else names a file
    try:
        text = value if inline else Path(value).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--schema {value}: not inline JSON and not a readable file ({exc.strerror})") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        where = "" if inline else f" in {value}"
        raise ConfigError(f"--schema: invalid JSON{where} (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"--schema: a JSON object of relations and classifications, not a {type(schema).__name__}")
    return schema
