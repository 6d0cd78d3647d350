"""`shoal extract` (the batch CLI) on a random-weight model of every extract kind, in process and
against a server: each kind's rows carry its fields (entities, labels, a GLiNER2 schema's
classifications and relations; a GLiREL model's relations between each row's entities, read from
.jsonl and .parquet rows; an image_labels model's labels per image file), the two ways give the
same rows, offsets slice the text sent, `--schema` is read inline or from a file, and `--kind`
checks the card's kind (from the catalog in process, from `GET /v1/models/{id}` with --url)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kind_models import KINDS, SENTIMENT, cards_dir, model_id, served_kinds
from shoal.cli import main

pytestmark = pytest.mark.timeout(300)

TEXTS = [
    "Barack Obama visited Paris with Angela Merkel in 2015 to meet the OECD.",
    "Zürich-based Nestlé S.A. opened a café in São Paulo — its 12th in Brazil 🍫.",
]
ENTITY_TYPES = ["person", "city", "organization"]
SCHEMA = {
    "relations": [{"works for": {"head": "", "tail": ""}}],
    "classifications": [{"task": "sentiment", "labels": SENTIMENT}],
}
# A GLiREL row's entities: these words of each text, found in it.
ENTITY_WORDS = [["Barack Obama", "Paris", "Angela Merkel", "OECD"], ["Nestlé", "São Paulo", "Brazil"]]
RELATION_TYPES = ["located in", "works for", "met with"]
PHOTO_COLOURS = {"red.png": (220, 30, 30), "blues/sky.png": (40, 90, 230), "green.jpg": (30, 200, 60)}
# The flags each kind is run with (beside --kind), and the fields its rows carry.
FLAGS = {
    "gliner": [f"--label={label}" for label in ENTITY_TYPES] + ["--threshold", "0.3"],
    "token_class": [],
    "zero_shot": ["--label=politics", "--label=food", "--multi-label"],
    "classify": ["--top-k", "2"],
    "gliclass": ["--label=politics", "--label=food", "--label=travel"],
    "gliner2": [f"--label={label}" for label in ENTITY_TYPES],  # and --schema, inline or a file
    "glirel": [f"--label={label}" for label in RELATION_TYPES] + ["--threshold", "0.2"],  # entities: the rows'
    "image_labels": ["--label=a red square", "--label=a blue square", "--label=a green square"],
}
FIELDS = {
    "gliner": {"entities"},
    "token_class": {"entities"},
    "zero_shot": {"labels"},
    "classify": {"labels"},
    "gliclass": {"labels"},
    "gliner2": {"entities", "labels", "classifications", "relations"},  # labels: its one task's
    "glirel": {"relations"},
    "image_labels": {"labels"},
}


def entities(text: str, words: list[str]) -> list[dict]:
    return [{"start": text.index(w), "end": text.index(w) + len(w), "label": "thing"} for w in words]


def glirel_rows(directory: Path) -> tuple[Path, Path]:
    """TEXTS with their entities (and ids) as a .jsonl and a .parquet file."""
    rows = [{"id": f"t{i}", "text": t, "entities": entities(t, w)} for i, (t, w) in enumerate(zip(TEXTS, ENTITY_WORDS))]
    jsonl, parquet = directory / "rows.jsonl", directory / "rows.parquet"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    return jsonl, parquet


@pytest.fixture(scope="module")
def served(serve, tmp_path_factory):
    """(cards folder, URL of a server of every kind's model, the kinds built)."""
    cards = cards_dir(tmp_path_factory)
    return cards, serve(cards_dirs=(cards,), preload=()), served_kinds(cards)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    from PIL import Image

    directory = tmp_path_factory.mktemp("photos")
    for name, colour in PHOTO_COLOURS.items():
        (directory / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (40, 30), colour).save(directory / name)
    return directory


def run(argv: list[str], capsys) -> tuple[int, list[dict], str]:
    """(exit code, the JSON rows printed, stderr) of `shoal ARGV`."""
    code = main(argv)
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def close(a, b, where: str = "") -> None:
    """The same rows, scores within 1e-5 (the server and the in-process engine batch alike)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, a, b)
        for key in a:
            close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, abs=1e-5), where
    else:
        assert a == b, where


def check_rows(kind: str, rows: list[dict], inputs: list[str]) -> None:
    """The rows name their inputs in order and carry the kind's fields, checked value by value."""
    key = "image" if kind == "image_labels" else "text"
    assert [row[key] for row in rows] == inputs
    for row in rows:
        assert set(row) - {key, "id"} == FIELDS[kind], row  # glirel rows keep their ids
        text = row.get("text", "")
        for entity in row.get("entities", []):
            assert entity["text"] == text[entity["start"] : entity["end"]] and 0 <= entity["score"] <= 1
        scores = [label["score"] for label in row.get("labels", [])]
        assert scores == sorted(scores, reverse=True)
    if kind == "classify":  # --top-k 2 of the model's own three labels
        assert all(len(row["labels"]) == 2 and {x["label"] for x in row["labels"]} <= set(SENTIMENT) for row in rows)
    if kind == "image_labels":  # softmax over the labels sent
        assert all(sum(x["score"] for x in row["labels"]) == pytest.approx(1, abs=1e-5) for row in rows)
        assert all(len(row["labels"]) == 3 for row in rows)
    if kind == "glirel":  # relations between the row's entities, each with its score
        found = 0
        for row, words in zip(rows, ENTITY_WORDS):
            assert list(row["relations"]) == RELATION_TYPES
            for instance in (r for found_type in row["relations"].values() for r in found_type):
                assert 0.2 < instance["score"] <= 1 and instance["head"]["score"] == instance["score"]
                assert instance["head"]["text"] in words and instance["tail"]["text"] in words
                assert instance["head"] != instance["tail"]
                found += 1
        assert found > 0
    if kind == "gliner2":
        for row in rows:
            (best,) = row["classifications"]["sentiment"]  # single-label: the best label
            assert best["label"] in SENTIMENT and row["labels"] == [best]  # labels: the one task's
            assert list(row["relations"]) == ["works for"] and row["relations"]["works for"]
            for instance in row["relations"]["works for"]:
                for end in (instance["head"], instance["tail"]):
                    assert end["text"] == row["text"][end["start"] : end["end"]]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kinds_rows_carry_its_fields_and_are_the_same_in_process_and_from_a_server(
    served, kind, photos, tmp_path, capsys
):
    cards, url, kinds = served
    if kind not in kinds:
        pytest.skip(f"{kind}: its reference package is not installed")
    given_local = None
    if kind == "image_labels":
        inputs, given = sorted(PHOTO_COLOURS), ["--images", str(photos)]
    elif kind == "glirel":  # each row's entities: from .jsonl in process, from .parquet to the server
        jsonl, parquet = glirel_rows(tmp_path)
        inputs, given, given_local = TEXTS, ["--input", str(parquet)], ["--input", str(jsonl)]
    else:
        inputs, given = TEXTS, TEXTS
    flags = [*FLAGS[kind], "--kind", kind, "--quiet"]
    local_flags, served_flags = list(flags), list(flags)
    if kind == "gliner2":  # the schema from a file in process, inline to the server
        (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
        local_flags += ["--schema", str(tmp_path / "schema.json")]
        served_flags += ["--schema", json.dumps(SCHEMA)]
    code, local, err = run(
        ["extract", model_id(kind), *(given_local or given), *local_flags, "--models-dir", str(cards), "--url", ""],
        capsys,
    )
    assert code == 0, err
    check_rows(kind, local, inputs)
    code, remote, err = run(["extract", model_id(kind), *given, *served_flags, "--url", url], capsys)
    assert code == 0, err
    close(local, remote)


def test_a_gliner2_schemas_relations_and_classifications_are_written_to_parquet_and_jsonl(served, tmp_path, capsys):
    cards, url, kinds = served
    if "gliner2" not in kinds:
        pytest.skip("gliner2 is not installed")
    flags = [*FLAGS["gliner2"], "--schema", json.dumps(SCHEMA), "--url", url, "--quiet"]
    code, printed, err = run(["extract", model_id("gliner2"), *TEXTS, *flags], capsys)
    assert code == 0, err
    for suffix in ("jsonl", "parquet"):
        out = tmp_path / f"rows.{suffix}"
        assert main(["extract", model_id("gliner2"), *TEXTS, *flags, "-o", str(out)]) == 0
        if suffix == "jsonl":
            rows = [json.loads(line) for line in out.read_text().splitlines()]
        else:
            rows = pq.read_table(out).to_pylist()
        close(printed, rows)


@pytest.mark.parametrize("where", ["in process", "server"])
def test_kind_checks_the_cards_kind_and_a_mismatch_is_one_line(served, where, capsys):
    cards, url, kinds = served
    place = ["--models-dir", str(cards), "--url", ""] if where == "in process" else ["--url", url]
    code, rows, err = run(["extract", model_id("classify"), *TEXTS, "--kind", "gliner2", *place], capsys)
    assert code == 2 and rows == []
    assert err.strip() == (
        f"shoal: --kind gliner2: {model_id('classify')} extracts as kind classify (its card decides), not gliner2"
    )
    code, rows, err = run(
        ["extract", "sentence-transformers/all-MiniLM-L6-v2", "x", "--kind", "gliner", *place], capsys
    )
    assert code == 2 and rows == [] and "does not extract (its card names no extract kind)" in err


@pytest.mark.parametrize(
    "schema, message",
    [
        ('{"relations": [', "--schema: invalid JSON (line 1, column 16"),
        ('["works for"]', "--schema: a JSON object of relations and classifications, not a list"),
        ("no/such/schema.json", "--schema no/such/schema.json: not inline JSON and not a readable file"),
    ],
)
def test_a_bad_schema_is_one_line_before_anything_runs(schema, message, capsys):
    code = main(["extract", model_id("gliner2"), "x", "--schema", schema, "--url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"shoal: {message}") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("where", ["in process", "server"])
def test_a_glirel_row_without_entities_or_a_schema_beside_them_is_one_line(served, where, tmp_path, capsys):
    cards, url, kinds = served
    if "glirel" not in kinds:
        pytest.skip("glirel is not installed")
    place = ["--models-dir", str(cards), "--url", ""] if where == "in process" else ["--url", url]
    jsonl, _ = glirel_rows(tmp_path)
    lines = jsonl.read_text().splitlines()
    (tmp_path / "missing.jsonl").write_text(lines[0] + "\n" + json.dumps({"id": "t1", "text": TEXTS[1]}) + "\n")
    model, label = model_id("glirel"), "--label=works for"
    cases = [
        (
            ["--input", str(tmp_path / "missing.jsonl")],
            "reads each row's entities: row 2 (id 't1')'s 'entities' field has none",
        ),
        ([TEXTS[0]], "reads each row's entities: row 1's 'entities' field has none"),
        (
            ["--input", str(jsonl), "--schema", '{"entities": []}'],
            "--schema: test/kind-glirel (kind glirel) reads each",
        ),
    ]
    for given, message in cases:
        code, rows, err = run(["extract", model, *given, label, *place], capsys)
        assert code == 2 and rows == [] and len(err.strip().splitlines()) == 1, err
        assert message in err, err
