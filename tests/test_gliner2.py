"""GLiNER2 (span architecture): shoal's schema prompt, word pooling, count gate, count-aware
queries, span scoring, per-type decoding, relation instances and classification against the
`gliner2` package's `extract_entities`, `extract_relations`, `classify_text` and `extract` on the
same random-initialised checkpoint, saved by its `save_pretrained` (same entities, relations and
labels, scores <= 1e-4), for the three counting layers; offsets checked by slicing the text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gliner2")

from engine_calls import catalog_with, run
from extract_models import deberta_v3_config, spread, unigram_tokenizer
from shoal.api.errors import status_of
from shoal.engine import ExtractCall
from shoal.errors import InvalidRequest

TEXTS = [
    "Barack Obama visited Paris with Angela Merkel in 2015 to meet the OECD.",
    "Apple Inc. hired Tim Cook 🍏 in Cupertino, California; shares rose 3.5% on the NASDAQ!",
    "Zürich-based Nestlé S.A. opened a café in São Paulo — its 12th in Brazil",
    "Write to jane.doe@example.com or @shoal_dev, see https://example.com/a?b=1 (v2.1)",
    "The model ran on 2 cores; latency fell from 270 ms to 150 ms?",
    "x",
]
LABEL_SETS = [["person", "city", "organization"], ["company", "date", "money", "product", "location"]]
DESCRIPTIONS = {"person": "a human being, by name", "organization": "a company or institution"}
MODEL = "test/gliner2"
WINDOWED = "test/gliner2-windows"  # the same folder, read in windows of 40 words sharing 10


def build_gliner2(directory: Path, seed: int, counting_layer: str, shape: dict | None = None):
    """A random GLiNER2 span model (DeBERTa-v3-like backbone, Unigram tokenizer) saved with its
    `save_pretrained`; returns the package's model loaded back from the folder."""
    from gliner2 import GLiNER2
    from gliner2.configuration import ExtractorConfig
    from transformers import AutoConfig

    base = directory.parent / f"{directory.name}-backbone"
    tokenizer = unigram_tokenizer(base)
    deberta_v3_config(len(tokenizer), **(shape or {})).save_pretrained(base)  # shape: the backbone's (bench)
    config = ExtractorConfig(model_name=str(base), max_width=8, counting_layer=counting_layer)
    torch.manual_seed(seed)
    model = GLiNER2(config, encoder_config=AutoConfig.from_pretrained(base))
    spread(model, seed)
    with torch.no_grad():  # most span tasks predict a count above 0 (else they find nothing)
        model.count_pred[-1].bias[1] += 2.0
    model.save_pretrained(str(directory))
    return GLiNER2.from_pretrained(str(directory)).eval()


def card(directory: Path, model: str = MODEL, extract: str = "") -> str:
    return f"""
id: {model}
tasks: [extract]
extract: {{kind: gliner2{extract}}}
source: {{path: {directory}}}
max_length: 512
"""


@pytest.fixture(scope="module", params=["count_lstm_v2", "count_lstm", "count_lstm_moe"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gliner2") / "model"
    reference = build_gliner2(directory, seed=3, counting_layer=request.param)
    catalog = catalog_with(directory.parent, card(directory))
    return catalog, reference


@pytest.fixture(scope="module")
def damped(tmp_path_factory):
    """A GLiNER2 whose span scorer's last layer is scaled by 0.05 (scores spread below 1), served
    as WINDOWED."""
    directory = tmp_path_factory.mktemp("gliner2-damped") / "model"
    reference = build_gliner2(directory, seed=5, counting_layer="count_lstm_v2")
    layer = reference.span_rep.span_rep_layer.out_project[3]
    with torch.no_grad():
        layer.weight.mul_(0.05)
        layer.bias.zero_()
    reference.save_pretrained(str(directory))
    windowed = card(directory, WINDOWED, ", max_words: 40, window_overlap_words: 10")
    return catalog_with(directory.parent, windowed), reference


def expected_entities(found: dict, text: str) -> list[tuple]:
    """The reference's entities as (start, end, label, score), an end in the "." it appends to the
    text cut at the text's end (shoal's offsets index the text as sent)."""
    out = []
    for label, spans in found.items():
        for span in spans:
            if span["start"] < len(text):
                out.append((span["start"], min(span["end"], len(text)), label, span["confidence"]))
    return sorted(out)


def assert_same_entities(expected: list[tuple], item, text: str, where: str) -> None:
    got = [(e.start, e.end, e.label, e.score) for e in item.entities]
    assert [g[:2] for g in got] == sorted(g[:2] for g in got)  # in order of start
    got.sort()
    assert [g[:3] for g in got] == [e[:3] for e in expected], where
    for e, g in zip(expected, got):
        assert abs(g[3] - e[3]) <= 1e-4, (where, e, g)
    for entity in item.entities:
        assert entity.text == text[entity.start : entity.end]


def test_entities_equal_gliner2_extract_entities(model):
    catalog, reference = model
    calls, expected = [], []
    for labels in LABEL_SETS:
        for threshold in (0.3, 0.8):
            calls.append(ExtractCall(model=MODEL, items=TEXTS, labels=labels, threshold=threshold))
            expected.append(
                [
                    expected_entities(
                        reference.extract_entities(
                            t, labels, threshold=threshold, include_confidence=True, include_spans=True
                        )["entities"],
                        t,
                    )
                    for t in TEXTS
                ]
            )
    # Entity types with descriptions ([DESCRIPTION] person: ... in the prompt).
    labels = LABEL_SETS[0]
    calls.append(ExtractCall(model=MODEL, items=TEXTS, labels=labels, schema={"entity_descriptions": DESCRIPTIONS}))
    described = {label: DESCRIPTIONS.get(label, "") for label in labels}
    described = {k: v for k, v in described.items()}
    expected.append(
        [
            expected_entities(
                reference.extract(
                    t,
                    reference.create_schema().entities(
                        {k: ({"description": v} if v else {}) for k, v in described.items()}
                    ),
                    threshold=0.5,
                    include_confidence=True,
                    include_spans=True,
                )["entities"],
                t,
            )
            for t in TEXTS
        ]
    )
    results = run(catalog, *calls)
    found = 0
    for call, result, want in zip(calls, results, expected):
        for i, (item, exp, text) in enumerate(zip(result.items, want, TEXTS)):
            assert_same_entities(exp, item, text, f"labels {call.labels} threshold {call.threshold} text {i}")
            found += len(exp)
    assert found > 60  # the comparison covers many entities, not empty lists


CLASSIFICATIONS = [
    {"task": "sentiment", "labels": ["positive", "negative", "neutral"]},
    {"task": "topic", "labels": {"politics": "government", "business": "companies", "science": "research"}},
    {"task": "tags", "labels": ["news", "tech", "travel", "food"], "multi_label": True, "cls_threshold": 0.3},
    {"task": "top", "labels": ["a", "b", "c", "d"], "multi_label": True, "cls_threshold": 0.1, "top_k": 2},
]


def reference_tasks() -> dict:
    return {c["task"]: {k: v for k, v in c.items() if k != "task"} for c in CLASSIFICATIONS}


def assert_same_labels(expected, got, where: str) -> None:
    expected = expected if isinstance(expected, list) else [expected]
    assert [e["label"] for e in expected] == [g.label for g in got], where
    for e, g in zip(expected, got):
        assert abs(e["confidence"] - g.score) <= 1e-4, (where, e, g)


def test_classifications_equal_gliner2_classify_text(model):
    catalog, reference = model
    (result,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS, schema={"classifications": CLASSIFICATIONS}))
    multi = 0
    for i, (item, text) in enumerate(zip(result.items, TEXTS)):
        want = reference.classify_text(text, reference_tasks(), include_confidence=True)
        assert item.entities is None and item.classifications is not None
        assert list(item.classifications) == [c["task"] for c in CLASSIFICATIONS]
        for task, got in item.classifications.items():
            assert_same_labels(want[task], got, f"text {i} task {task}")
        multi += len(item.classifications["tags"])
    assert multi > len(TEXTS)  # multi-label tasks return several labels somewhere
    # One task: its labels are also the item's `labels`.
    (single,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS[:1], schema={"classifications": CLASSIFICATIONS[:1]}))
    assert single.items[0].labels == single.items[0].classifications["sentiment"]


def test_entities_and_classifications_in_one_schema_equal_gliner2_extract(model):
    """Both tasks in one sequence, as the package's `extract` builds it from a schema."""
    catalog, reference = model
    labels = LABEL_SETS[0]
    schema = {"entity_descriptions": DESCRIPTIONS, "classifications": CLASSIFICATIONS[:2]}
    (result,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS, labels=labels, threshold=0.4, schema=schema))
    found = 0
    for i, (item, text) in enumerate(zip(result.items, TEXTS)):
        s = reference.create_schema().entities(
            {label: ({"description": DESCRIPTIONS[label]} if label in DESCRIPTIONS else {}) for label in labels}
        )
        for c in CLASSIFICATIONS[:2]:
            s = s.classification(c["task"], c["labels"])
        want = reference.extract(text, s, threshold=0.4, include_confidence=True, include_spans=True)
        exp = expected_entities(want["entities"], text)
        assert_same_entities(exp, item, text, f"text {i}")
        found += len(exp)
        for c in CLASSIFICATIONS[:2]:
            assert_same_labels(want[c["task"]], item.classifications[c["task"]], f"text {i} {c['task']}")
    assert found > 10


RELATION_SETS = [
    ["works_for", "located_in", "founded"],
    {"born_in": "where a person was born", "acquired": "a company buying another", "met": "two people meeting"},
]


def relation_schema(types) -> dict:
    """The package's schema dict for `types` (a list, or type -> description)."""
    schema: dict = {"relations": [{name: {"head": "", "tail": ""}} for name in types]}
    if isinstance(types, dict):
        schema["relation_descriptions"] = dict(types)
    return schema


def expected_relations(found: dict, types, text: str) -> dict:
    """The reference's relations as ((start, end, score) of head, of tail) per type; an end in the
    "." it appends cut at the text's end, an instance with that "." alone as head or tail left out
    (shoal's offsets index the text as sent). The package files a described type's instances under
    "type: description" (its prompt) and lists the bare type empty; shoal answers by type."""

    def span(s: dict) -> tuple:
        return (s["start"], min(s["end"], len(text)), s["confidence"])

    out = {}
    for name in types:
        key = f"{name}: {types[name]}" if isinstance(types, dict) else name
        out[name] = [
            (span(r["head"]), span(r["tail"]))
            for r in found[key]
            if r["head"]["start"] < len(text) and r["tail"]["start"] < len(text)
        ]
    return out


def assert_same_relations(expected: dict, item, text: str, where: str) -> None:
    assert item.relations is not None and list(item.relations) == list(expected), where
    for name, want in expected.items():
        got = item.relations[name]
        assert len(got) == len(want), (where, name, want, got)
        for (head, tail), relation in zip(want, got):
            for e, g in ((head, relation.head), (tail, relation.tail)):
                assert (g.start, g.end) == e[:2], (where, name, e, g)
                assert abs(g.score - e[2]) <= 1e-4, (where, name, e, g)
                assert g.text == text[g.start : g.end]


def test_relations_equal_gliner2_extract_relations(model):
    catalog, reference = model
    calls, expected = [], []
    for types in RELATION_SETS:
        for threshold in (0.3, 0.5):
            calls.append(ExtractCall(model=MODEL, items=TEXTS, schema=relation_schema(types), threshold=threshold))
            expected.append(
                [
                    expected_relations(
                        reference.extract_relations(
                            t, types, threshold=threshold, include_confidence=True, include_spans=True
                        )["relation_extraction"],
                        types,
                        t,
                    )
                    for t in TEXTS
                ]
            )
    results = run(catalog, *calls)
    found, several = 0, 0
    for call, result, want in zip(calls, results, expected):
        for i, (item, exp, text) in enumerate(zip(result.items, want, TEXTS)):
            assert item.entities is None and item.classifications is None
            assert_same_relations(exp, item, text, f"relations {list(exp)} threshold {call.threshold} text {i}")
            found += sum(len(v) for v in exp.values())
            several += sum(len(v) > 1 for v in exp.values())
    assert found > 20 and several > 0  # many instances compared, some types with more than one


def test_entities_relations_and_classifications_in_one_schema_equal_gliner2_extract(model):
    """All three tasks in one sequence, as the package's `extract` builds it from a schema."""
    catalog, reference = model
    labels, types = LABEL_SETS[0], RELATION_SETS[1]
    schema = {"entity_descriptions": DESCRIPTIONS, **relation_schema(types), "classifications": CLASSIFICATIONS[:2]}
    (result,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS, labels=labels, threshold=0.4, schema=schema))
    entities = relations = 0
    for i, (item, text) in enumerate(zip(result.items, TEXTS)):
        s = reference.create_schema().entities(
            {label: ({"description": DESCRIPTIONS[label]} if label in DESCRIPTIONS else {}) for label in labels}
        )
        s = s.relations(types)
        for c in CLASSIFICATIONS[:2]:
            s = s.classification(c["task"], c["labels"])
        want = reference.extract(text, s, threshold=0.4, include_confidence=True, include_spans=True)
        exp = expected_entities(want["entities"], text)
        assert_same_entities(exp, item, text, f"text {i}")
        rel = expected_relations(want["relation_extraction"], types, text)
        assert_same_relations(rel, item, text, f"text {i}")
        entities += len(exp)
        relations += sum(len(v) for v in rel.values())
        for c in CLASSIFICATIONS[:2]:
            assert_same_labels(want[c["task"]], item.classifications[c["task"]], f"text {i} {c['task']}")
    assert entities > 10 and relations > 5


@pytest.mark.parametrize(
    "labels,schema,field",
    [
        (["person"], {"relations": [{"works_for": {"tail": "", "head": ""}}]}, "relations[0]"),
        (["person"], {"relations": ["works_for"]}, "relations[0]"),
        (
            ["person"],
            {"relations": [{"works_for": {"head": "", "tail": ""}}], "relation_descriptions": {"born_in": "a place"}},
            "relation_descriptions",
        ),
        (["person"], {"json_structures": []}, "json_structures"),
        (["person"], {"entity_descriptions": {"city": "a town"}}, "entity_descriptions"),
        ([], {"classifications": [{"task": "t", "labels": []}]}, "classifications[0].labels"),
        (
            [],
            {"classifications": [{"task": "t", "labels": ["a"], "cls_threshold": 2}]},
            "classifications[0].cls_threshold",
        ),
        ([], {"classifications": [{"task": "t", "labels": ["a"], "true_label": "a"}]}, "classifications[0]"),
        ([], {"classifications": "sentiment"}, "classifications"),
        ([], None, None),
    ],
)
def test_a_bad_schema_is_a_400_naming_the_field(model, labels, schema, field):
    catalog, _ = model
    (error,) = run(
        catalog, ExtractCall(model=MODEL, items=TEXTS[:1], labels=labels, schema=schema), catch=(InvalidRequest,)
    )
    assert isinstance(error, InvalidRequest), error
    assert status_of(error) == 400
    if field is not None:
        assert error.details["field"] == field


def test_options_of_other_kinds_are_refused_and_long_texts_read_in_windows(model):
    catalog, reference = model
    long_text = " ".join(TEXTS[:3] * 40)
    labels = LABEL_SETS[0]
    flat, long_result = run(
        catalog,
        ExtractCall(model=MODEL, items=TEXTS[:1], labels=labels, flat_ner=False),
        ExtractCall(model=MODEL, items=[long_text], labels=labels),
        catch=(InvalidRequest,),
    )
    assert isinstance(flat, InvalidRequest) and flat.details["option"] == "flat_ner"
    item = long_result.items[0]
    assert item.num_windows > 1 and len(item.entities) > 10
    for entity in item.entities:
        assert entity.text == long_text[entity.start : entity.end]


def test_long_texts_relations_and_classifications_equal_gliner2_batch_extract_long(damped):
    """A text read in windows: each window is the package's chunk (40 words, 10 shared), relations
    and labels merged across windows as its `batch_extract_long` merges them, so an instance with
    both ends in an overlap is found once. The span scorer is damped so that scores do not
    saturate at 1.0, where the best span of an instance would be a tie decided by rounding."""
    catalog, reference = damped
    # Windows end inside sentences and at their ends ("?", "."); the text ends in "." as the
    # package's last chunk does not get one appended.
    texts = [" ".join(TEXTS[:5] * 4) + " Done.", " ".join(TEXTS[1:4] * 2) + " ok."]
    types = RELATION_SETS[0]
    tasks = [CLASSIFICATIONS[0], CLASSIFICATIONS[2]]  # single- and multi-label
    schema = {**relation_schema(types), "classifications": tasks}
    (result,) = run(catalog, ExtractCall(model=WINDOWED, items=texts, threshold=0.3, schema=schema))
    s = reference.create_schema().relations(types)
    for c in tasks:
        s = s.classification(
            c["task"], c["labels"], multi_label=c.get("multi_label", False), cls_threshold=c.get("cls_threshold", 0.5)
        )
    wants = reference.batch_extract_long(
        texts, s, threshold=0.3, include_confidence=True, include_spans=True, chunk_size=40, chunk_overlap=10
    )
    found = 0
    for i, (item, text, want) in enumerate(zip(result.items, texts, wants)):
        assert item.num_windows > 2, item.num_windows
        rel = expected_relations(want["relation_extraction"], types, text)
        assert_same_relations(rel, item, text, f"long text {i}")
        found += sum(len(v) for v in rel.values())
        for c in tasks:
            assert_same_labels(want[c["task"]], item.classifications[c["task"]], f"long text {i} {c['task']}")
    assert found > 20


def test_a_schema_over_http_and_through_the_sdk_answers_as_the_engine_does(model, serve):
    """`schema` travels in POST /v1/extract (JSON) and the SDK; `classifications` and `relations`
    come back."""
    import httpx

    from shoal.sdk import Client

    catalog, _ = model
    cards = Path(catalog.get(MODEL).source.path).parent / "cards"  # where catalog_with wrote the card
    schema = {"classifications": CLASSIFICATIONS[:2], **relation_schema(RELATION_SETS[1])}
    (want,) = run(catalog, ExtractCall(model=MODEL, items=TEXTS[:3], labels=LABEL_SETS[0], schema=schema))
    url = serve(cards_dirs=(cards,), preload=(MODEL,))
    body = {"model": MODEL, "items": [{"text": t} for t in TEXTS[:3]], "labels": LABEL_SETS[0], "schema": schema}
    answer = httpx.post(f"{url}/v1/extract", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    with Client(url) as client:
        through_sdk = client.extract(MODEL, TEXTS[:3], LABEL_SETS[0], schema=schema)
    for got, sdk_item, item in zip(answer.json()["items"], through_sdk, want.items):
        assert [(e["start"], e["end"], e["label"]) for e in got["entities"]] == [
            (e.start, e.end, e.label) for e in item.entities
        ]
        assert sdk_item.entities == item.entities
        assert sdk_item.relations == item.relations and any(item.relations.values())
        for name, relations in item.relations.items():
            assert [(r["head"]["start"], r["tail"]["end"]) for r in got["relations"][name]] == [
                (r.head.start, r.tail.end) for r in relations
            ]
        for task, labels in item.classifications.items():
            assert [x["label"] for x in got["classifications"][task]] == [x.label for x in labels]
            assert [x["score"] for x in got["classifications"][task]] == pytest.approx(
                [x.score for x in labels], abs=1e-6
            )
            assert [x.label for x in sdk_item.classifications[task]] == [x.label for x in labels]


def test_an_adapter_on_a_gliner2_model_is_a_400_saying_lora_is_not_supported(model):
    catalog, _ = model
    (refused,) = run(
        catalog, ExtractCall(model=MODEL, items=TEXTS[:1], labels=["person"], adapter="mine"), catch=(InvalidRequest,)
    )
    assert isinstance(refused, InvalidRequest) and "GLiNER2 model: LoRA adapters are not supported" in str(refused)
