"""GLiNER2 structured records and classification prompts: shoal's `structures` (fields as dicts and
as `name::dtype::[a|b]::description` strings, span fields and choice fields, per-field thresholds)
and a classification task's `prompt` and few-shot `examples`, against the `gliner2` package's
`extract` on the same random checkpoint (same records, values and scores <= 1e-4), alone and in one
schema with entities, relations and classifications; long texts against `batch_extract_long`;
offsets checked by slicing the text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gliner2")

from engine_calls import catalog_with, run
from shoal.api.errors import status_of
from shoal.engine import ExtractCall
from shoal.errors import InvalidRequest
from test_gliner2 import (
    CLASSIFICATIONS,
    LABEL_SETS,
    MODEL,
    RELATION_SETS,
    TEXTS,
    WINDOWED,
    assert_same_labels,
    build_gliner2,
    card,
    expected_relations,
    relation_schema,
)

# A dict-form structure (the package's Schema.from_dict) and a string-form one (its extract_json).
STRUCTURES = {
    "visit": {
        "fields": [
            {"name": "person", "dtype": "str", "description": "who travelled"},
            {"name": "places", "description": "where they went"},
            {"name": "role", "dtype": "str", "choices": ["leader", "guest", "Staff"]},
            {"name": "topics", "choices": ["politics", "business", "travel", "food"], "threshold": 0.3},
            {"name": "year", "dtype": "str", "threshold": 0.7},
        ]
    },
    "deal": ["buyer::str::the company paying", "amount", "kind::[merger|hire|sale]", "markets::[nasdaq|nyse]::list"],
}


@pytest.fixture(scope="module", params=["count_lstm_v2", "count_lstm"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gliner2-structures") / "model"
    reference = build_gliner2(directory, seed=11, counting_layer=request.param)
    return catalog_with(directory.parent, card(directory)), reference


@pytest.fixture(scope="module")
def damped(tmp_path_factory):
    """Span scores spread below 1 (see test_gliner2's damped), served as WINDOWED too."""
    directory = tmp_path_factory.mktemp("gliner2-structures-damped") / "model"
    reference = build_gliner2(directory, seed=7, counting_layer="count_lstm_v2")
    layer = reference.span_rep.span_rep_layer.out_project[3]
    with torch.no_grad():
        layer.weight.mul_(0.05)
        layer.bias.zero_()
    reference.save_pretrained(str(directory))
    windowed = card(directory, WINDOWED, ", max_words: 40, window_overlap_words: 10")
    return catalog_with(directory.parent, card(directory), windowed), reference


def reference_schema(reference, structures: dict):
    """The package's Schema: dict-form structures through Schema.from_dict, string-form fields
    through the parser of its extract_json."""
    from gliner2.inference.schema import Schema

    schema = Schema.from_dict({"structures": {n: b for n, b in structures.items() if isinstance(b, dict)}})
    for name, fields in structures.items():
        if isinstance(fields, list):
            builder = schema.structure(name)
            for spec in fields:
                field, dtype, choices, description = reference._parse_field_spec(spec)
                builder.field(field, dtype=dtype, choices=choices, description=description)
    return schema


def expected_records(found, text: str) -> list[dict]:
    """The reference's records as {field: value}, a span value (start, end, score), a choice
    ("choice", text, score); a span that is the "." the package appends alone left out (None for
    a str field), an end in it cut at the text's end, a record left with no value left out. The
    package answers {} when the count gate says none, [] when no record has a value."""

    def value(v):
        if "start" not in v:
            return ("choice", v["text"], v["confidence"])
        if v["start"] >= len(text):
            return None
        return (v["start"], min(v["end"], len(text)), v["confidence"])

    out = []
    for record in found or []:
        mine = {}
        for field, v in record.items():
            if v is None:
                mine[field] = None
            elif isinstance(v, list):
                mine[field] = [x for x in map(value, v) if x is not None]
            else:
                mine[field] = value(v)
        if any(v is not None and v != [] for v in mine.values()):
            out.append(mine)
    return out


def got_records(records, text: str) -> list[dict]:
    def value(v):
        if v.start is None:
            return ("choice", v.text, v.score)
        assert v.text == text[v.start : v.end]
        return (v.start, v.end, v.score)

    return [
        {f: None if v is None else [value(x) for x in v] if isinstance(v, list) else value(v) for f, v in r.items()}
        for r in records
    ]


def assert_same_records(expected: list[dict], got: list[dict], where: str) -> None:
    assert len(got) == len(expected), (where, expected, got)
    for e, g in zip(expected, got):
        assert list(g) == list(e), (where, e, g)
        for field in e:
            ev, gv = e[field], g[field]
            pairs = list(zip(ev, gv)) if isinstance(ev, list) else [(ev, gv)]
            assert (len(ev) == len(gv)) if isinstance(ev, list) else ((ev is None) == (gv is None)), (where, e, g)
            for x, y in pairs:
                if x is None:
                    continue
                assert x[:-1] == y[:-1], (where, field, x, y)
                assert abs(x[-1] - y[-1]) <= 1e-4, (where, field, x, y)


def test_structures_equal_gliner2_extract(model):
    catalog, reference = model
    calls, wants = [], []
    for threshold in (0.3, 0.6):
        calls.append(ExtractCall(model=MODEL, items=TEXTS, schema={"structures": STRUCTURES}, threshold=threshold))
        schema = reference_schema(reference, STRUCTURES)
        wants.append(
            [
                reference.extract(t, schema, threshold=threshold, include_confidence=True, include_spans=True)
                for t in TEXTS
            ]
        )
    results = run(catalog, *calls)
    records = spans = choices = 0
    for call, result, want in zip(calls, results, wants):
        for i, (item, text, w) in enumerate(zip(result.items, TEXTS, want)):
            assert item.entities is None and item.relations is None
            assert list(item.structures) == list(STRUCTURES)
            for name in STRUCTURES:
                exp = expected_records(w[name], text)
                got = got_records(item.structures[name], text)
                assert_same_records(exp, got, f"{name} threshold {call.threshold} text {i}")
                records += len(exp)
                for r in exp:
                    for v in r.values():
                        for x in v if isinstance(v, list) else [v]:
                            if x is not None:
                                choices += x[0] == "choice"
                                spans += x[0] != "choice"
    assert records > 10 and spans > 10 and choices > 5  # records of several values of both kinds compared


def test_structures_with_entities_relations_and_classifications_in_one_schema_equal_gliner2_extract(model):
    """Structures come first in the sequence and their choices sit before the text: the other
    tasks read the same words shifted."""
    catalog, reference = model
    labels, types = LABEL_SETS[0], RELATION_SETS[0]
    tasks = CLASSIFICATIONS[:1] + [
        {
            "task": "stance",
            "labels": ["for", "against"],
            "prompt": "the writer's view",
            "examples": [["I love it", "for"], ["never again", "against"]],
        }
    ]
    schema = {"structures": STRUCTURES, **relation_schema(types), "classifications": tasks}
    (result,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS, labels=labels, threshold=0.4, schema=schema))
    s = reference_schema(reference, STRUCTURES).entities(labels).relations(types)
    for c in tasks:
        s = s.classification(c["task"], c["labels"], **{k: c[k] for k in ("prompt", "examples") if k in c})
    entities = records = 0
    for i, (item, text) in enumerate(zip(result.items, TEXTS)):
        want = reference.extract(text, s, threshold=0.4, include_confidence=True, include_spans=True)
        got = sorted((e.start, e.end, e.label) for e in item.entities)
        exp = sorted(
            (x["start"], min(x["end"], len(text)), label)
            for label, xs in want["entities"].items()
            for x in xs
            if x["start"] < len(text)
        )
        assert got == exp, f"text {i}"
        rel = expected_relations(want["relation_extraction"], types, text)
        assert {k: len(v) for k, v in rel.items()} == {k: len(v) for k, v in item.relations.items()}, f"text {i}"
        for name in STRUCTURES:
            exp_records = expected_records(want[name], text)
            assert_same_records(exp_records, got_records(item.structures[name], text), f"{name} text {i}")
            records += len(exp_records)
        # The package files a task under its prompt's first word group ("task: prompt ...").
        for c in tasks:
            key = next(k for k in want if k == c["task"] or k.startswith(c["task"] + ": "))
            assert_same_labels(want[key], item.classifications[c["task"]], f"text {i} {c['task']}")
        entities += len(exp)
    assert entities > 5 and records > 5


def test_long_texts_structures_equal_gliner2_batch_extract_long(damped):
    """Each window repeats the choices before its words; records found in two windows (all their
    spans in the overlap) are kept once, as batch_extract_long merges its chunks."""
    catalog, reference = damped
    texts = [" ".join(TEXTS[:5] * 4) + " Done.", " ".join(TEXTS[1:4] * 2) + " ok."]
    # One-value records recur in neighbouring windows: the merge keeps them once.
    structures = {**STRUCTURES, "mention": ["who::str", "kind::[merger|hire|sale]::str"]}
    (long_result, short_result) = run(
        catalog,
        ExtractCall(model=WINDOWED, items=texts, threshold=0.3, schema={"structures": structures}),
        ExtractCall(model=MODEL, items=TEXTS[:3], threshold=0.3, schema={"structures": structures}),
    )
    schema = reference_schema(reference, structures)
    wants = reference.batch_extract_long(
        texts, schema, threshold=0.3, include_confidence=True, include_spans=True, chunk_size=40, chunk_overlap=10
    )
    found = 0
    for i, (item, text, want) in enumerate(zip(long_result.items, texts, wants)):
        assert item.num_windows > 2, item.num_windows
        for name in structures:
            exp = expected_records(want[name], text)
            assert_same_records(exp, got_records(item.structures[name], text), f"long text {i} {name}")
            found += len(exp)
    assert found > 10
    for i, (item, text) in enumerate(zip(short_result.items, TEXTS[:3])):
        want = reference.extract(text, schema, threshold=0.3, include_confidence=True, include_spans=True)
        for name in structures:
            exp = expected_records(want[name], text)
            assert_same_records(exp, got_records(item.structures[name], text), f"damped text {i} {name}")


@pytest.mark.parametrize(
    "schema,field",
    [
        ({"json_structures": [{"visit": {"person": ""}}]}, "json_structures"),
        ({"structures": ["visit"]}, "structures"),
        ({"structures": {"visit": {"fields": []}}}, "structures.visit.fields"),
        ({"structures": {"visit": {"fields": ["a"], "mode": "natural"}}}, "structures.visit"),
        ({"structures": {"visit": {"fields": [{"name": "a", "dtype": "int"}]}}}, "structures.visit.fields[0].dtype"),
        ({"structures": {"visit": {"fields": [{"name": "a", "cardinality": "one"}]}}}, "structures.visit.fields[0]"),
        ({"structures": {"visit": {"fields": [{"name": "a", "choices": []}]}}}, "structures.visit.fields[0].choices"),
        (
            {"structures": {"visit": {"fields": [{"name": "a", "threshold": 1.5}]}}},
            "structures.visit.fields[0].threshold",
        ),
        ({"structures": {"visit": {"fields": ["a", "a::str"]}}}, "structures.visit.fields"),
        ({"structures": {"visit": {"fields": [""]}}}, "structures.visit.fields[0].name"),
        (
            {"classifications": [{"task": "t", "labels": ["a", "b"], "examples": [["x", "c"]]}]},
            "classifications[0].examples[0]",
        ),
        ({"classifications": [{"task": "t", "labels": ["a"], "examples": ["x"]}]}, "classifications[0].examples[0]"),
    ],
)
def test_a_bad_structure_or_example_is_a_400_naming_the_field(model, schema, field):
    catalog, _ = model
    (error,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS[:1], schema=schema), catch=(InvalidRequest,))
    assert isinstance(error, InvalidRequest), error
    assert status_of(error) == 400
    assert error.details["field"] == field, error.details


def test_structures_over_http_through_the_sdk_and_the_batch_cli_answer_as_the_engine_does(model, serve, tmp_path):
    """`structures` travel in POST /v1/extract (JSON), the SDK and `shoal extract --schema`."""
    import json

    import httpx

    from shoal.cli import main
    from shoal.sdk import Client

    catalog, _ = model
    cards = Path(catalog.get(MODEL).source.path).parent / "cards"
    schema = {"structures": STRUCTURES}
    (want,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS[:3], threshold=0.3, schema=schema))
    assert any(want.items[i].structures["visit"] for i in range(3))
    url = serve(cards_dirs=(cards,), preload=(MODEL,))
    body = {"model": MODEL, "items": [{"text": t} for t in TEXTS[:3]], "schema": schema, "options": {"threshold": 0.3}}
    answer = httpx.post(f"{url}/v1/extract", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    with Client(url) as client:
        through_sdk = client.extract(MODEL, TEXTS[:3], schema=schema, threshold=0.3)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3]))
    out = tmp_path / "rows.jsonl"
    cli = ["extract", MODEL, "--input", str(texts), "--url", url, "-o", str(out), "-q", "--threshold", "0.3"]
    assert main([*cli, "--schema", json.dumps(schema)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for got, sdk_item, row, item in zip(answer.json()["items"], through_sdk, rows, want.items):
        assert sdk_item.structures == item.structures
        for name, records in item.structures.items():
            assert len(got["structures"][name]) == len(row["structures"][name]) == len(records)
            for g, r, rec in zip(got["structures"][name], row["structures"][name], records):
                for field, v in rec.items():
                    values = v if isinstance(v, list) else [v]
                    for key in (g, r):
                        w = key[field] if isinstance(key[field], list) else [key[field]]
                        assert [x and x["text"] for x in w] == [x and x.text for x in values]
                        assert [x and x.get("start") for x in w] == [x and x.start for x in values]
