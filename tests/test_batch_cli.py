"""`shoal encode|score|extract` over files: .txt/.jsonl/.parquet in, .jsonl/.npy/.parquet out, in
process or against a server (`--url`), with a summary line; a bad file is named with its line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import MODEL_ID
from shoal.cli import main

TEXTS = [
    "The cat sat on the mat.",
    "Stocks fell sharply on Monday.",
    "A dog slept in the sun.",
    "Rain is expected tomorrow.",
    "The match ended in a draw.",
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_encode_in_process_from_jsonl_to_npy_and_jsonl_equals_the_reference(tmp_path, embed_reference, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": f"doc-{i}", "text": t} for i, t in enumerate(TEXTS)])
    assert (
        main(["encode", MODEL_ID, "--input", str(source), "--output", str(tmp_path / "out.npy"), "--batch-size", "2"])
        == 0
    )
    vectors = np.load(tmp_path / "out.npy")
    assert vectors.shape == (5, 384) and np.abs(vectors - embed_reference(TEXTS)).max() <= 1e-5
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("shoal encode: 5 items,") and "tokens/s" in summary
    assert main(["encode", MODEL_ID, "-i", str(source), "-o", str(tmp_path / "out.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"doc-{i}" for i in range(5)]
    assert np.abs(np.array([r["dense"] for r in rows]) - vectors).max() <= 1e-5


def test_encode_against_a_server_from_txt_to_parquet_keeps_the_order(base_url, tmp_path, embed_reference):
    (tmp_path / "in.txt").write_text("\n".join(TEXTS) + "\n")
    assert (
        main(
            [
                "encode",
                MODEL_ID,
                "--url",
                base_url,
                "-i",
                str(tmp_path / "in.txt"),
                "-o",
                str(tmp_path / "out.parquet"),
                "--batch-size",
                "2",
                "--concurrency",
                "3",
            ]
        )
        == 0
    )
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [row["text"] for row in table] == TEXTS
    assert np.abs(np.array([row["dense"] for row in table]) - embed_reference(TEXTS)).max() <= 1e-5


def test_score_against_a_server_ranks_every_chunk_together(base_url, tmp_path, embed_reference, capsys):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    query = "weather forecast"
    assert (
        main(["score", MODEL_ID, query, "--url", base_url, "-i", str(source), "--batch-size", "2", "--top-k", "3"]) == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    vectors = embed_reference([query, *TEXTS])
    expected = np.argsort(-(vectors[1:] @ vectors[0]), kind="stable")[:3]
    assert [r["index"] for r in rows] == list(expected) and [r["id"] for r in rows] == list(expected)
    assert np.allclose([r["score"] for r in rows], np.sort(vectors[1:] @ vectors[0])[::-1][:3], atol=1e-5)


def test_extract_in_process_from_parquet_writes_entities_that_slice_the_text(tmp_path):
    from extract_models import build_token_classifier, extract_card

    directory = tmp_path / "tagger"
    directory.mkdir()
    build_token_classifier(directory, seed=3)
    cards = tmp_path / "cards"
    cards.mkdir()
    (cards / "tagger.yaml").write_text(extract_card(directory, "test/tagger", "token_class"))
    texts = ["Ada Lovelace met Charles Babbage in London", "the Royal Society in Paris and Berlin"]
    pq.write_table(pa.table({"body": texts, "id": [7, 8]}), tmp_path / "in.parquet")
    assert (
        main(
            [
                "extract",
                "--models-dir",
                str(cards),
                "test/tagger",
                "-i",
                str(tmp_path / "in.parquet"),
                "--field",
                "body",
                "-o",
                str(tmp_path / "out.jsonl"),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [7, 8]
    assert sum(len(r["entities"]) for r in rows) > 0
    assert all(r["text"][e["start"] : e["end"]] == e["text"] for r in rows for e in r["entities"])


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', "bad.jsonl:3: not JSON"),
        (
            "field.jsonl",
            '{"text": "a"}\n{"body": "b"}\n',
            "field.jsonl:2: each line must be an object with a string 'text'",
        ),
        ("texts.csv", "a,b\n", "read .txt (a text a line), .jsonl or .parquet"),
    ],
)
def test_a_bad_input_file_is_named_with_its_line(tmp_path, capsys, name, content, words):
    (tmp_path / name).write_text(content)
    assert main(["encode", MODEL_ID, "-i", str(tmp_path / name)]) == 2
    assert words in capsys.readouterr().err


def test_a_parquet_without_the_column_and_an_unknown_output_suffix_are_refused(tmp_path, capsys):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "in.parquet")
    assert main(["encode", MODEL_ID, "-i", str(tmp_path / "in.parquet")]) == 2
    assert "no column 'text' (its columns: body)" in capsys.readouterr().err
    assert main(["score", MODEL_ID, "q", "doc", "-o", str(tmp_path / "out.npy")]) == 2
    assert "score writes .jsonl, .parquet" in capsys.readouterr().err


def test_a_zero_batch_size_is_refused_and_an_unreachable_url_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["encode", MODEL_ID, "x", "--batch-size", "0"])
    assert exit_info.value.code == 2 and "must be an integer >= 1" in capsys.readouterr().err
    assert main(["encode", MODEL_ID, "x", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal: cannot reach http://127.0.0.1:9") and "Traceback" not in err
