"""The batch CLI as a new user meets it: a blank line keeps its row, a bad output path or input
file is one line before anything runs, a missing pyarrow or torch says what to install, the token
count of `extract --url` is the server's, parquet vectors keep the output dtype, and the encode
options (`--normalize`, `--output-dtype`, `--prompt-name`, sparse models), `SHOAL_URL` /
`SHOAL_API_KEY` and `--quiet` work, each against its reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import MODEL_ID
from shoal.cli import main

TEXTS = ["The cat sat on the mat.", "Stocks fell sharply on Monday.", "Rain is expected tomorrow."]
UNREACHABLE = "http://127.0.0.1:9"  # a run that got as far as sending would fail with "cannot reach"
TOKEN = "batch-cli-token-0123456789"


def one_line(err: str) -> str:
    """The one error line a refused run prints, checked to be the only line and no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shoal: ") and "Traceback" not in err, err
    return lines[0]


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_without(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`shoal ARGS` in a fresh interpreter where `import MODULE` fails as it does when the package is
    not installed (None in sys.modules: ModuleNotFoundError naming it)."""
    code = f"import sys; sys.modules[{module!r}] = None; from shoal.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if k not in ("SHOAL_URL", "SHOAL_API_KEY")}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


# --- rows follow lines ---------------------------------------------------------------------------


def test_a_blank_txt_line_keeps_its_row_and_gets_the_empty_texts_vector(base_url, tmp_path, embed_reference):
    lines = [TEXTS[0], "", TEXTS[1], "   ", TEXTS[2]]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["encode", MODEL_ID, "--url", base_url, "-i", str(tmp_path / "in.txt"), "-o", str(out)]) == 0
    rows = jsonl_rows(out)
    assert [r["text"] for r in rows] == lines
    assert np.abs(np.array([r["dense"] for r in rows]) - embed_reference(lines)).max() <= 1e-5


def test_score_over_a_txt_with_blank_lines_indexes_documents_by_their_line(base_url, tmp_path, capsys):
    lines = [TEXTS[0], "", TEXTS[2]]
    (tmp_path / "docs.txt").write_text("\n".join(lines) + "\n")
    assert main(["score", MODEL_ID, "weather tomorrow", "--url", base_url, "-i", str(tmp_path / "docs.txt")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1, 2]
    assert all(r["document"] == lines[r["index"]] for r in rows) and rows[0]["index"] == 2


# --- refused before the run, in one line ---------------------------------------------------------


@pytest.mark.parametrize(
    "where, words",
    [
        ("missing/out.jsonl", "no such folder"),
        ("afile.txt/out.jsonl", "is not a folder"),
        ("adir", "is a folder"),
        ("out.csv", "encode writes .jsonl, .npy, .parquet, not .csv"),
    ],
)
def test_a_bad_output_path_is_one_line_before_any_text_is_sent(tmp_path, capsys, where, words):
    (tmp_path / "afile.txt").write_text("x")
    (tmp_path / "adir").mkdir()
    assert main(["encode", MODEL_ID, "hello", "--url", UNREACHABLE, "-o", str(tmp_path / where)]) == 2
    assert words in one_line(capsys.readouterr().err)
    assert not (tmp_path / "missing").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_an_unwritable_output_folder_is_one_line_before_any_text_is_sent(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert main(["encode", MODEL_ID, "hello", "--url", UNREACHABLE, "-o", str(locked / "out.jsonl")]) == 2
    assert "cannot write" in one_line(capsys.readouterr().err)


def test_a_corrupt_parquet_input_is_one_line(tmp_path, capsys):
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "good.parquet")
    (tmp_path / "bad.parquet").write_bytes((tmp_path / "good.parquet").read_bytes()[:-20])  # footer cut off
    assert main(["encode", MODEL_ID, "--url", UNREACHABLE, "-i", str(tmp_path / "bad.parquet")]) == 2
    line = one_line(capsys.readouterr().err)
    assert "bad.parquet" in line and "not a readable parquet file" in line


def test_without_pyarrow_parquet_in_or_out_says_to_install_it(tmp_path):
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "in.parquet")
    reading = run_without("pyarrow", ["encode", MODEL_ID, "--url", UNREACHABLE, "-i", "in.parquet"], tmp_path)
    writing = run_without("pyarrow", ["encode", MODEL_ID, "hi", "--url", UNREACHABLE, "-o", "out.parquet"], tmp_path)
    for done in (reading, writing):
        assert done.returncode == 2 and "pip install pyarrow" in one_line(done.stderr)
    assert not (tmp_path / "out.parquet").exists()


def test_without_torch_an_in_process_run_says_to_install_the_engine_or_use_url(tmp_path):
    done = run_without("torch", ["encode", MODEL_ID, "hello"], tmp_path)
    line = one_line(done.stderr)
    assert done.returncode == 2 and "pip install 'shoal[engine]'" in line and "--url" in line


# --- extract against a server with tokens --------------------------------------------------------


@pytest.fixture(scope="module")
def tagger(serve, tmp_path_factory):
    """(cards folder, URL of a server that asks for TOKEN) with a small random token classifier."""
    from extract_models import build_token_classifier, extract_card
    from shoal.api.auth import Auth

    root = tmp_path_factory.mktemp("tagger")
    build_token_classifier(root / "weights", seed=3)
    (root / "cards").mkdir()
    (root / "cards" / "tagger.yaml").write_text(extract_card(root / "weights", "test/tagger", "token_class"))
    url = serve(cards_dirs=(root / "cards",), preload=("test/tagger",), auth=Auth.from_sources(tokens=TOKEN))
    return root / "cards", url


def test_extract_against_a_server_counts_the_tokens_the_server_reports(tagger, tmp_path, capsys):
    _, url = tagger
    lines = ["Ada Lovelace met Charles Babbage in London", "", "the Royal Society in Paris and Berlin"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    args = ["extract", "test/tagger", "--url", url, "--api-key", TOKEN, "-i", str(tmp_path / "in.txt")]
    assert main([*args, "--batch-size", "2"]) == 0
    out, err = capsys.readouterr()
    answer = httpx.post(
        f"{url}/v1/extract",
        json={"model": "test/tagger", "items": [{"text": t} for t in lines]},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    num_tokens = answer.json()["usage"]["tokens"]
    assert num_tokens > 0 and f", {num_tokens} tokens in" in err.strip().splitlines()[-1]
    assert [json.loads(line)["text"] for line in out.splitlines()] == lines


def test_shoal_url_and_shoal_api_key_come_from_the_environment(tagger, tmp_path, monkeypatch, capsys):
    cards, url = tagger
    monkeypatch.setenv("SHOAL_URL", url)
    monkeypatch.setenv("SHOAL_API_KEY", "wrong-token-0123456789")
    assert main(["extract", "test/tagger", "Ada met Charles"]) == 2
    assert "bearer token is not valid" in one_line(capsys.readouterr().err)
    monkeypatch.setenv("SHOAL_API_KEY", TOKEN)
    assert main(["extract", "test/tagger", "Ada met Charles"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "Ada met Charles"
    monkeypatch.setenv("SHOAL_URL", UNREACHABLE)  # --url '' runs in process whatever SHOAL_URL says
    assert main(["extract", "test/tagger", "Ada met Charles", "--url", "", "--models-dir", str(cards)]) == 0


# --- what encode writes --------------------------------------------------------------------------


def test_parquet_vectors_are_float32_and_output_dtype_picks_another(base_url, tmp_path, embed_reference):
    from sentence_transformers.util.quantization import quantize_embeddings

    reference = embed_reference(TEXTS)
    expected = {
        "float32": (pa.float32(), reference, 1e-5),
        "float16": (pa.float16(), reference.astype(np.float16), 1e-3),
        "ubinary": (pa.uint8(), quantize_embeddings(reference, precision="ubinary"), 0),
        "binary": (pa.int8(), quantize_embeddings(reference, precision="binary"), 0),
    }
    for dtype, (arrow_type, vectors, tolerance) in expected.items():
        out = tmp_path / f"{dtype}.parquet"
        flags = [] if dtype == "float32" else ["--output-dtype", dtype]  # float32 is the default
        assert main(["encode", MODEL_ID, *TEXTS, "--url", base_url, "-o", str(out), *flags]) == 0
        table = pq.read_table(out)
        assert table.schema.field("dense").type.value_type == arrow_type, dtype
        got = np.array(table.column("dense").to_pylist(), dtype=np.float64)
        assert np.abs(got - vectors.astype(np.float64)).max() <= tolerance, dtype
    argv = ["encode", MODEL_ID, *TEXTS, "--url", base_url, "-o", str(tmp_path / "u.jsonl")]
    assert main([*argv, "--output-dtype", "ubinary"]) == 0
    rows = jsonl_rows(tmp_path / "u.jsonl")
    assert [r["dense"] for r in rows] == expected["ubinary"][1].tolist()


def test_no_normalize_writes_the_pooled_vectors_as_the_reference_pools_them(base_url, tmp_path, reference_model):
    from sentence_transformers import SentenceTransformer

    pooled = SentenceTransformer(modules=[reference_model[0], reference_model[1]], device="cpu").encode(TEXTS)
    assert np.linalg.norm(pooled, axis=1).min() > 1.5  # MiniLM's mean pooling, before its Normalize
    out = tmp_path / "out.npy"
    assert main(["encode", MODEL_ID, *TEXTS, "--url", base_url, "-o", str(out), "--no-normalize"]) == 0
    assert np.allclose(np.load(out), pooled, rtol=1e-4, atol=1e-5)


def test_prompt_name_prepends_the_cards_prompt_of_that_name(model_dir, tmp_path, embed_reference):
    cards = tmp_path / "cards"
    cards.mkdir()
    (cards / "prompted.yaml").write_text(
        f"""
id: test/minilm-prompted
architecture: bert
source: {{path: {model_dir}}}
max_length: 256
pooling: mean
normalize: true
dimensions: 384
outputs: [dense]
prompts: {{topic: "topic: "}}
"""
    )
    out = tmp_path / "out.npy"
    argv = ["encode", "test/minilm-prompted", *TEXTS, "--models-dir", str(cards), "-o", str(out)]
    assert main([*argv, "--prompt-name", "topic"]) == 0
    assert np.abs(np.load(out) - embed_reference([f"topic: {t}" for t in TEXTS])).max() <= 1e-5


SPLADE = "rasyosef/splade-tiny"


@pytest.fixture(scope="module")
def splade_weights():
    """Term weights per text from transformers' BertForMaskedLM: max_t log(1 + relu(logits))."""
    import torch
    import transformers

    from shoal.catalog import Catalog, resolve_weights

    directory = resolve_weights(Catalog.load().get(SPLADE), allow_download=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForMaskedLM.from_pretrained(directory).eval()
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    return (torch.log1p(torch.relu(logits)) * batch["attention_mask"][..., None]).max(dim=1).values.numpy()


def dense_of(indices: list[int], values: list[float], size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.float32)
    out[indices] = values
    return out


def test_a_sparse_model_writes_indices_and_values_in_parquet_and_jsonl(base_url, tmp_path, splade_weights, capsys):
    vocab_size = splade_weights.shape[1]
    out = tmp_path / "out.parquet"
    assert main(["encode", SPLADE, *TEXTS, "-o", str(out)]) == 0  # in process
    table = pq.read_table(out)
    assert table.schema.field("sparse").type == pa.struct(
        [("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float32()))]
    )
    assert "dense" not in table.column_names
    for row, expected in zip(table.column("sparse").to_pylist(), splade_weights):
        assert np.abs(dense_of(row["indices"], row["values"], vocab_size) - expected).max() <= 1e-4
    out = tmp_path / "out.jsonl"
    assert main(["encode", SPLADE, *TEXTS, "--url", base_url, "-o", str(out), "--outputs", "sparse"]) == 0
    for row, expected in zip(jsonl_rows(out), splade_weights):
        sparse = row["sparse"]
        assert np.abs(dense_of(sparse["indices"], sparse["values"], vocab_size) - expected).max() <= 1e-4
    capsys.readouterr()
    assert main(["encode", SPLADE, *TEXTS, "--url", base_url, "-o", str(tmp_path / "out.npy"), "--quiet"]) == 2
    assert ".npy holds dense vectors only" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "out.npy").exists()


def test_quiet_prints_no_progress_and_no_summary(base_url, tmp_path, capsys):
    argv = ["encode", MODEL_ID, *TEXTS, "--url", base_url, "-o", str(tmp_path / "out.jsonl")]
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == "" and len(jsonl_rows(tmp_path / "out.jsonl")) == 3
    assert main(argv) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("shoal encode: 3 items,")
