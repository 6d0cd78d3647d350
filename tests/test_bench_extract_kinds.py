"""`shoal bench --workload extract` against a random-weight model of every extract kind, served from
its folder: each kind's calls carry what it reads (labels for GLiNER, GLiClass and NLI zero-shot;
none for token and text classifiers; GLiNER2's entity types with a relation type and a
classification task; GLiREL's relation types with each tweet's entities, words of the tweet;
photos with labels for image_labels), every request of the ramp is answered
200, and the figures follow from the calls (items = calls x items per call, tokens counted)."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

from kind_models import KINDS, cards_dir, model_id, served_kinds
from shoal.bench import run as bench_run
from shoal.bench import workloads
from shoal.bench.load import _body
from shoal.catalog import Catalog
from shoal.cli import main
from shoal.spans import split_words

pytestmark = pytest.mark.timeout(300)

# The fields each kind's answer carries for the workload's calls.
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


@pytest.fixture(scope="module")
def served(serve, tmp_path_factory):
    """(cards folder, URL of a server with every kind's model preloaded, the kinds built)."""
    cards = cards_dir(tmp_path_factory)
    kinds = served_kinds(cards)
    return cards, serve(cards_dirs=(cards,), preload=tuple(model_id(k) for k in sorted(kinds))), kinds


def test_the_extract_workloads_calls_take_their_shape_from_the_cards_kind(served):
    cards, _, kinds = served
    catalog = Catalog.load(extra_dirs=(cards,))
    shapes = {k: workloads.extract_shape(catalog.get(model_id(k))) for k in kinds}
    calls = {k: workloads.build("extract", num_calls=4, extract=shape).calls[0] for k, shape in shapes.items()}
    for kind in kinds & {"gliner", "gliclass", "zero_shot", "gliner2"}:
        assert calls[kind].labels == workloads.WNUT_LABELS and len(calls[kind].texts) == 8
    for kind in kinds & {"token_class", "classify"}:
        assert calls[kind].labels is None and calls[kind].schema is None and len(calls[kind].texts) == 8
    if "gliner2" in kinds:
        assert calls["gliner2"].schema == workloads.GLINER2_SCHEMA
    if "glirel" in kinds:  # up to four words of each tweet, as the glirel task splits it
        glirel = calls["glirel"]
        assert glirel.labels == workloads.GLIREL_TYPES and len(glirel.schema["entities"]) == len(glirel.texts) == 8
        for text, entities in zip(glirel.texts, glirel.schema["entities"]):
            _, starts, ends = split_words(text)
            spans = [(e["start"], e["end"]) for e in entities]
            assert 2 <= len(spans) <= 4 and spans == sorted(spans)
            assert all(a in starts and b in ends and text[a:b][0].isalnum() for a, b in spans)
        assert workloads.build("extract", num_calls=4, extract=shapes["glirel"]).calls == (
            workloads.build("extract", num_calls=4, extract=shapes["glirel"]).calls
        )  # deterministic
    for kind in kinds - {"gliner2", "glirel"}:
        assert calls[kind].schema is None
    if "image_labels" in kinds:
        photo = calls["image_labels"]
        assert photo.texts == () and len(photo.images) == 8 and photo.labels == workloads.PHOTO_LABELS
    # a card of no extract kind (an embedder) gets the labels, as before kinds had shapes
    assert (
        workloads.extract_shape(catalog.get("sentence-transformers/all-MiniLM-L6-v2")).labels == workloads.WNUT_LABELS
    )


@pytest.mark.parametrize("kind", KINDS)
def test_shoal_bench_extract_serves_every_call_of_each_kind_and_reports_its_figures(
    served, kind, tmp_path, capsys, monkeypatch
):
    cards, url, kinds = served
    if kind not in kinds:
        pytest.skip(f"{kind}: its reference package is not installed")
    # The fp32 GEMM probe (a share of the bound) is tested in test_bench.py; here it would only cost time.
    monkeypatch.setattr(bench_run, "_gemm_probe", lambda: (1e11, 2))
    out = tmp_path / "bench.json"
    argv = ["bench", model_id(kind), "--url", url, "--models-dir", str(cards), "--workload", "extract"]
    argv += ["--mode", "closed", "--levels", "1,2", "--step-s", "1", "--p99-ms", "60000", "--json-out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "knee shoal:" in printed
    record = json.loads(out.read_text())
    shape = workloads.EXTRACT_SHAPES[kind]
    assert record["description"].endswith(shape.note)
    steps = record["targets"]["shoal"]["steps"]
    assert [s["offered"] for s in steps] == [1, 2]
    for step in steps:
        # every request answered 200; 8 texts (or photos) per call; usage counts tokens for each
        assert step["ok"] > 0 and step["errors"] == 0 and step["statuses"] == {"200": step["ok"]}
        items = step["items_per_s"] * step["duration_s"]  # both rounded: items_per_s to 0.1, duration_s to 1 ms
        assert items == pytest.approx(8 * step["ok"], abs=0.06 * step["duration_s"] + 0.001 * items)
        assert step["tokens_per_s"] > step["items_per_s"] > 0
        assert step["p99_ms"] >= step["p50_ms"] > 0
    assert record["targets"]["shoal"]["knee"]["ok"] > 0

    # The workload's first call as the bench sent it: answered with the kind's fields, and GLiNER2's
    # relation type and classification task answered by name.
    catalog = Catalog.load(extra_dirs=(cards,))
    call = workloads.build("extract", extract=workloads.extract_shape(catalog.get(model_id(kind)))).calls[0]
    body = msgspec.json.encode(_body("native", model_id(kind), "extract", call))
    answer = httpx.post(f"{url}/v1/extract", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert answer.status_code == 200, answer.text
    items = answer.json()["items"]
    assert len(items) == 8
    for item in items:
        assert set(item) - {"id", "index", "num_windows", "truncated"} <= FIELDS[kind]
    assert set().union(*(set(item) for item in items)) >= FIELDS[kind]
    if kind == "gliner2":
        assert all(set(item["relations"]) == {"works for"} for item in items)
        assert all(set(item["classifications"]) == {"sentiment"} for item in items)
        assert all(len(item["classifications"]["sentiment"]) == 1 for item in items)  # single-label: the best
    if kind == "glirel":  # every tweet of two or more entities read, each type answered by name
        assert all(list(item["relations"]) == list(workloads.GLIREL_TYPES) for item in items)
        assert sum(item.get("num_windows", 1) for item in items) == sum(len(e) >= 2 for e in call.schema["entities"])
