"""GLiREL relation extraction: shoal's relation-type prompt, word pooling, LSTM, entity and pair
representations and scorers against the `glirel` package's `predict_relations` on the same
random-initialised checkpoint, saved by its `save_pretrained` (same relations, scores <= 1e-4),
for both span markers, the three label embeddings, the four scorers, a projected hidden size and
a pair distance limit; offsets checked by slicing the text; bad entities are 400s naming the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import transformers

pytest.importorskip("glirel")

from engine_calls import catalog_with, run
from extract_models import deberta_v3_config, spread, unigram_tokenizer
from shoal.api.errors import status_of
from shoal.engine import ExtractCall
from shoal.errors import InvalidRequest
from shoal.spans import split_words

MODEL = "test/glirel"
TEXTS = [
    "Barack Obama visited Paris with Angela Merkel in 2015 to meet the OECD.",
    "Apple Inc. hired Tim Cook 🍏 in Cupertino, California; shares rose 3.5% on the NASDAQ!",
    "Zürich-based Nestlé S.A. opened a café in São Paulo — its 12th in Brazil.",
    "Marie Curie and Pierre Curie won the Nobel Prize in Physics in 1903 in Stockholm.",
]
# Each text's entities as words (first, last inclusive), the package's `ner` form.
NER = [
    [(0, 1), (3, 3), (5, 6), (12, 12)],
    [(0, 1), (4, 5), (8, 8), (10, 10), (20, 20)],
    [(0, 2), (3, 3), (9, 10), (16, 16)],
    [(0, 1), (3, 4), (7, 11), (13, 13), (15, 15)],
]
TYPES = [["founded by", "located in", "works for", "met with"], ["member of", "capital of"]]
# (glirel config overrides, hidden size): what each parity model varies.
VARIANTS = {
    "markerv1-ent_token-dot": {},
    "markerv2-label-dot_thresh-last": dict(
        span_marker_mode="markerv2", label_embed_strategy="label", scorer="dot_thresh", subtoken_pooling="last"
    ),
    "both-dot_norm-projected-distance": dict(
        label_embed_strategy="both", scorer="dot_norm", hidden_size=48, max_entity_pair_distance=4
    ),
    "concat_proj": dict(scorer="concat_proj"),
}


def build_glirel(directory: Path, seed: int, shape: dict | None = None, **over):
    """A random GLiREL (DeBERTa-v3-like backbone, Unigram tokenizer) saved with its
    `save_pretrained`; the backbone folder (config, tokenizer, weights: GLiREL loads its backbone by
    name) beside it; `shape` overrides the backbone's size (bench). Returns the package's model
    loaded back from the folder."""
    from glirel import GLiREL

    base = directory.parent / f"{directory.name}-backbone"
    tokenizer = unigram_tokenizer(base)
    torch.manual_seed(seed)
    transformers.DebertaV2Model(deberta_v3_config(len(tokenizer), **(shape or {}))).save_pretrained(base)
    config = {
        **dict(
            model_name=str(base),
            fine_tune=True,
            subtoken_pooling="first",
            hidden_size=32,
            max_width=12,
            dropout=0.0,
            rel_mode="marker",
            span_marker_mode="markerv1",
            label_embed_strategy="ent_token",
            scorer="dot",
            max_len=384,
            max_entity_pair_distance=None,
            fixed_relation_types=True,
            device="cpu",
        ),
        **over,
    }
    model = GLiREL(argparse.Namespace(**config))
    spread(model, seed)
    with torch.no_grad():  # relation logits of a few units (undamped they saturate at 1.0)
        for layer in (model.prompt_rep_layer[3],):
            layer.weight.mul_(0.05)
            layer.bias.mul_(0.05)
    model.save_pretrained(directory)
    # The package's own loader, called directly: its `from_pretrained` goes through a huggingface_hub
    # that no longer passes the proxies and resume_download its `_from_pretrained` requires.
    loaded = GLiREL._from_pretrained(
        model_id=str(directory),
        revision=None,
        cache_dir=None,
        force_download=False,
        proxies=None,
        resume_download=False,
        local_files_only=True,
        token=None,
    )
    return loaded.eval()


def card(directory: Path, extract: str = "") -> str:
    return f"""
id: {MODEL}
tasks: [extract]
extract: {{kind: glirel, backbone: {{path: {directory.parent / (directory.name + "-backbone")}}}{extract}}}
source: {{path: {directory}}}
max_length: 512
"""


def entities_of(text: str, ner: list[tuple[int, int]], label: str = "thing") -> list[dict]:
    _, starts, ends = split_words(text)
    return [{"start": int(starts[a]), "end": int(ends[b]), "label": label} for a, b in ner]


def expected(reference, text: str, ner, types, threshold: float, top_k: int = -1) -> dict[str, list]:
    """predict_relations' relations by type, each ((head start, end), (tail start, end), score) in
    characters, in pair order."""
    _, starts, ends = split_words(text)
    found = reference.predict_relations(
        text, types, threshold=threshold, ner=[[a, b, "thing", ""] for a, b in ner], top_k=top_k
    )
    pair_index = {(ner[i], ner[j]): i * len(ner) + j for i in range(len(ner)) for j in range(len(ner))}
    out: dict[str, list] = {t: [] for t in types}
    for r in found:
        (hs, he), (ts, te) = r["head_pos"], r["tail_pos"]  # words, the end exclusive
        head, tail = (int(starts[hs]), int(ends[he - 1])), (int(starts[ts]), int(ends[te - 1]))
        out[r["label"]].append((pair_index[((hs, he - 1), (ts, te - 1))], head, tail, r["score"]))
    return {t: [x[1:] for x in sorted(v, key=lambda x: x[0])] for t, v in out.items()}


def assert_same(want: dict, item, text: str, where: str) -> float:
    """The item's relations equal `want`; spans slice the text; returns the largest score difference."""
    assert set(item.relations) == set(want), where
    worst = 0.0
    for label, relations in want.items():
        got = item.relations[label]
        assert [(r.head.start, r.head.end, r.tail.start, r.tail.end) for r in got] == [
            (*h, *t) for h, t, _ in relations
        ], (where, label)
        for r, (_, _, score) in zip(got, relations):
            assert r.head.text == text[r.head.start : r.head.end] and r.tail.text == text[r.tail.start : r.tail.end]
            assert r.score == r.head.score == r.tail.score
            worst = max(worst, abs(r.score - score))
            assert abs(r.score - score) <= 1e-4, (where, label, r, score)
    return worst


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("glirel") / "model"
    reference = build_glirel(directory, seed=3, **VARIANTS[request.param])
    return catalog_with(directory.parent, card(directory)), reference


def test_relations_equal_glirel_predict_relations(model):
    catalog, reference = model
    entities = [entities_of(t, n) for t, n in zip(TEXTS, NER)]
    calls, wants = [], []
    for types in TYPES:
        for threshold in (0.1, 0.5, 0.9):
            calls.append(
                ExtractCall(model=MODEL, items=TEXTS, labels=types, threshold=threshold, schema={"entities": entities})
            )
            wants.append([expected(reference, t, n, types, threshold) for t, n in zip(TEXTS, NER)])
    results = run(catalog, *calls)
    found = worst = 0
    for call, result, want in zip(calls, results, wants):
        for i, (item, w, text) in enumerate(zip(result.items, want, TEXTS)):
            worst = max(worst, assert_same(w, item, text, f"types {call.labels} threshold {call.threshold} text {i}"))
            found += sum(len(v) for v in w.values())
    print(f"largest score difference {worst:.2e} over {found} relations")
    assert found > 100


def test_top_k_a_text_without_relations_and_texts_without_pairs(model):
    """top_k keeps each pair's best types (predict_relations' top_k); a threshold just above a
    text's best score leaves it every type with no relation while the next text keeps some; a text
    with one entity or none is not read (num_windows 0) and has no relations."""
    catalog, reference = model
    types = TYPES[0]
    best = max(
        r["score"]
        for r in reference.predict_relations(TEXTS[0], types, threshold=0.0, ner=[[*n, "x", ""] for n in NER[0]])
    )
    threshold = min(best + 1e-3, 0.9999)
    entities = [entities_of(t, n) for t, n in zip(TEXTS, NER)]
    calls = [
        ExtractCall(model=MODEL, items=TEXTS, labels=types, threshold=0.2, top_k=1, schema={"entities": entities}),
        ExtractCall(model=MODEL, items=TEXTS, labels=types, threshold=0.05, top_k=2, schema={"entities": entities}),
        ExtractCall(model=MODEL, items=TEXTS[:2], labels=types, threshold=threshold, schema={"entities": entities[:2]}),
        ExtractCall(
            model=MODEL,
            items=["Paris.", "", TEXTS[0]],
            labels=types,
            schema={"entities": [entities[0][:0], [], entities[0]]},
        ),
    ]
    top1, top2, quiet, few = run(catalog, *calls)
    for result, k, threshold_k in ((top1, 1, 0.2), (top2, 2, 0.05)):
        for i, (item, text, ner) in enumerate(zip(result.items, TEXTS, NER)):
            assert_same(expected(reference, text, ner, types, threshold_k, top_k=k), item, text, f"top_k {k} text {i}")
        per_pair: dict = {}
        for relations in result.items[1].relations.values():
            for r in relations:
                per_pair[(r.head.start, r.tail.start)] = per_pair.get((r.head.start, r.tail.start), 0) + 1
        assert per_pair and max(per_pair.values()) <= k
    assert quiet.items[0].relations == {t: [] for t in types}
    assert expected(reference, TEXTS[0], NER[0], types, threshold) == {t: [] for t in types}
    assert_same(expected(reference, TEXTS[1], NER[1], types, threshold), quiet.items[1], TEXTS[1], "text 1")
    assert [item.num_windows for item in few.items] == [0, 0, 1]
    assert few.items[0].relations == few.items[1].relations == {t: [] for t in types}
    assert_same(expected(reference, TEXTS[0], NER[0], types, 0.5), few.items[2], TEXTS[0], "default threshold")


def bad_calls() -> list[tuple[dict, str]]:
    """(ExtractCall fields, the field its 400 names)."""
    ok = [entities_of(TEXTS[0], NER[0])]
    off_word = [[{"start": 1, "end": 12}, *ok[0][1:]]]  # "arack Obama"
    mid_word = [[{"start": 0, "end": 3}, *ok[0][1:]]]  # "Bar"
    return [
        (dict(labels=[], schema={"entities": ok}), "labels"),
        (dict(labels=["x"]), "schema"),
        (dict(labels=["x"], schema={"entities": []}), "entities"),
        (dict(labels=["x"], schema={"entities": ok, "relations": []}), "relations"),
        (dict(labels=["x"], schema={"entities": [[{"start": 0, "end": 500}, *ok[0][1:]]]}), "schema.entities[0][0]"),
        (dict(labels=["x"], schema={"entities": [[{"start": 5, "end": 5}, *ok[0][1:]]]}), "schema.entities[0][0]"),
        (dict(labels=["x"], schema={"entities": [[{"start": "0", "end": 5}, *ok[0][1:]]]}), "schema.entities[0][0]"),
        (dict(labels=["x"], schema={"entities": [[*ok[0], ok[0][0]]]}), "schema.entities[0][4]"),
        (dict(labels=["x"], schema={"entities": off_word}), "schema.entities[0][0]"),
        (dict(labels=["x"], schema={"entities": mid_word}), "schema.entities[0][0]"),
        (dict(labels=["x"], schema={"entities": ok}, top_k=0), "top_k"),
        (dict(labels=["x"], schema={"entities": ok}, flat_ner=True), "flat_ner"),
    ]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The first variant's model, for the tests that do not depend on the variant."""
    directory = tmp_path_factory.mktemp("glirel-plain") / "model"
    reference = build_glirel(directory, seed=3)
    return catalog_with(directory.parent, card(directory)), reference


def test_bad_entities_and_options_are_400s_naming_the_field(plain):
    catalog, _ = plain
    cases = bad_calls()
    refused = run(catalog, *(ExtractCall(model=MODEL, items=TEXTS[:1], **f) for f, _ in cases), catch=(InvalidRequest,))
    for (fields, field), exc in zip(cases, refused):
        assert isinstance(exc, InvalidRequest), (fields, exc)
        assert status_of(exc) == 400
        assert field in (exc.details.get("field"), exc.details.get("option")), (fields, exc.details)


def test_over_http_and_the_sdk_answers_as_the_engine_does(plain, serve):
    """Entities travel in POST /v1/extract's `schema` (JSON), relations come back with their score;
    a bad entity is a 400 naming it; a LoRA adapter is refused."""
    import httpx

    from shoal.sdk import Client

    catalog, _ = plain
    cards = Path(catalog.get(MODEL).source.path).parent / "cards"  # where catalog_with wrote the card
    schema = {"entities": [entities_of(t, n) for t, n in zip(TEXTS, NER)]}
    (want,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS, labels=TYPES[0], threshold=0.3, schema=schema))
    url = serve(cards_dirs=(cards,), preload=(MODEL,))
    body = {
        "model": MODEL,
        "items": [{"text": t} for t in TEXTS],
        "labels": TYPES[0],
        "schema": schema,
        "options": {"threshold": 0.3},
    }
    answer = httpx.post(f"{url}/v1/extract", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    with Client(url) as client:
        through_sdk = client.extract(MODEL, TEXTS, TYPES[0], schema=schema, threshold=0.3)
    for got, sdk_item, item in zip(answer.json()["items"], through_sdk, want.items):
        # The same relations; scores to float32 rounding (the server's batch may run on other
        # threads than the engine's here, which changes the last bits of a sum).
        assert sdk_item.relations.keys() == item.relations.keys()
        for name, relations in item.relations.items():
            theirs = sdk_item.relations[name]
            assert [(r.head.text, r.head.start, r.head.end, r.tail.text, r.tail.start, r.tail.end) for r in theirs] == [
                (r.head.text, r.head.start, r.head.end, r.tail.text, r.tail.start, r.tail.end) for r in relations
            ]
            assert [r.score for r in theirs] == pytest.approx([r.score for r in relations], abs=1e-6)
        for name, relations in item.relations.items():
            assert [
                (r["head"]["start"], r["head"]["end"], r["tail"]["start"], r["tail"]["end"])
                for r in got["relations"][name]
            ] == [(r.head.start, r.head.end, r.tail.start, r.tail.end) for r in relations]
            assert [r["score"] for r in got["relations"][name]] == pytest.approx([r.score for r in relations], abs=1e-6)
    assert sum(len(v) for item in want.items for v in item.relations.values()) > 10
    bad = {**body, "schema": {"entities": [[{"start": 0, "end": 3}, {"start": 4, "end": 9}]] * len(TEXTS)}}
    refused = httpx.post(f"{url}/v1/extract", json=bad, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["details"]["field"] == "schema.entities[0][0]"
    adapter = httpx.post(f"{url}/v1/extract", json={**body, "adapter": "mine"}, timeout=60)
    assert adapter.status_code == 400 and "GLiREL model: LoRA adapters are not supported" in adapter.text
