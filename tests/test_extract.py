"""Token-classification NER and zero-shot classification through the engine, against transformers'
token-classification and zero-shot-classification pipelines on random-initialised models (the
references run here); long texts read in token windows; the card and call checks."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from engine_calls import catalog_with, run
from extract_models import build_nli, build_token_classifier, extract_card
from shoal.catalog import parse_card
from shoal.engine import ExtractCall
from shoal.errors import CardError, InvalidRequest

TEXTS = [
    "Angela Merkel met Barack Obama in Berlin on Monday.",
    "Apple Inc. hired Tim Cook in Cupertino, California; shares rose 3.5% 🍏.",
    "Zürich-based Nestlé opened a café in São Paulo — its twelfth in Brazil.",
    "hello",
]


@pytest.fixture(scope="module")
def tagger(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tagger")
    model, tokenizer = build_token_classifier(directory, seed=3)
    return directory, model, tokenizer


@pytest.mark.parametrize("strategy", ["simple", "first", "max", "average"])
def test_token_class_entities_equal_the_pipeline(tmp_path, tagger, strategy):
    directory, model, tokenizer = tagger
    pipe = transformers.pipeline(
        "token-classification", model=model, tokenizer=tokenizer, aggregation_strategy=strategy, device="cpu"
    )
    catalog = catalog_with(tmp_path, extract_card(directory, "test/tagger", "token_class"))
    (result,) = run(catalog, ExtractCall(model="test/tagger", items=TEXTS, aggregation=strategy))
    total = 0
    for text, item in zip(TEXTS, result.items):
        expected = pipe(text)
        assert [(e["start"], e["end"], e["entity_group"]) for e in expected] == [
            (e.start, e.end, e.label) for e in item.entities
        ], text
        for e, g in zip(expected, item.entities):
            assert abs(float(e["score"]) - g.score) <= 1e-4
            assert g.text == text[g.start : g.end]
        total += len(expected)
    assert total > 5


def test_token_class_labels_filter_and_threshold(tmp_path, tagger):
    directory, _, _ = tagger
    catalog = catalog_with(tmp_path, extract_card(directory, "test/tagger", "token_class"))
    whole, only, above, unknown = run(
        catalog,
        ExtractCall(model="test/tagger", items=TEXTS),
        ExtractCall(model="test/tagger", items=TEXTS, labels=["PER"]),
        ExtractCall(model="test/tagger", items=TEXTS, threshold=0.5),
        ExtractCall(model="test/tagger", items=TEXTS, labels=["person"]),
        catch=(InvalidRequest,),
    )
    everything = [e for item in whole.items for e in item.entities]
    assert {e.label for e in everything} > {"PER"}

    def same(got, want) -> bool:  # the calls' batches differ (lanes split them): scores to float32's last bits
        return [(e.text, e.label, e.start, e.end) for e in got] == [
            (e.text, e.label, e.start, e.end) for e in want
        ] and [e.score for e in got] == pytest.approx([e.score for e in want], rel=1e-5)

    assert same([e for item in only.items for e in item.entities], [e for e in everything if e.label == "PER"])
    assert same([e for item in above.items for e in item.entities], [e for e in everything if e.score >= 0.5])
    assert isinstance(unknown, InvalidRequest) and "PER" in unknown.message and "'person'" in unknown.message


def test_a_long_text_is_tagged_in_token_windows(tmp_path, tagger):
    """A text of ~2,000 tokens through a 128-token window: each token keeps the logits of the
    window it sits most inside (overlaps split at their middle), as transformers' model gives them
    for that window alone; the stitched logits are aggregated as the pipeline does (the aggregation
    is proven equal to the pipeline above)."""
    import torch

    from shoal.spans import aggregate_entities

    directory, model, tokenizer = tagger
    catalog = catalog_with(
        tmp_path, extract_card(directory, "test/tagger", "token_class", max_length=128, window_overlap_tokens=32)
    )
    text = " ".join(TEXTS[:3] * 40)
    (result,) = run(catalog, ExtractCall(model="test/tagger", items=[text], aggregation="first"))
    item = result.items[0]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    n, size, overlap = len(enc["input_ids"]), 126, 32
    spans, a = [], 0
    while True:
        spans.append((a, min(n, a + size)))
        if a + size >= n:
            break
        a += size - overlap
    assert n > 1500 and item.num_windows == len(spans) > 10
    cuts = [0] + [(b[0] + a_[1]) // 2 for a_, b in zip(spans, spans[1:])] + [n]
    logits = np.zeros((n, model.config.num_labels), dtype=np.float32)
    with torch.no_grad():
        for (a, b), lo, hi in zip(spans, cuts, cuts[1:]):
            ids = [tokenizer.cls_token_id, *enc["input_ids"][a:b], tokenizer.sep_token_id]
            logits[lo:hi] = model(torch.tensor([ids])).logits[0, 1:-1].numpy()[lo - a : hi - a]
    expected = aggregate_entities(
        logits, model.config.id2label, np.asarray(enc["offset_mapping"]), np.asarray(enc.word_ids()), text, "first"
    )
    assert [(e["start"], e["end"], e["label"]) for e in expected] == [(e.start, e.end, e.label) for e in item.entities]
    np.testing.assert_allclose([e.score for e in item.entities], [e["score"] for e in expected], atol=1e-4)
    assert max(e.end for e in item.entities) > len(text) * 0.95  # the end of the text is tagged too


@pytest.fixture(
    scope="module",
    params=[["contradiction", "entailment", "neutral"], ["entailment", "not_entailment"]],
    ids=["3-label", "2-label"],
)
def nli(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("nli")
    model, tokenizer = build_nli(directory, request.param, seed=4)
    return directory, model, tokenizer


@pytest.mark.parametrize("multi_label", [False, True])
def test_zero_shot_scores_equal_the_pipeline(tmp_path, nli, multi_label):
    directory, model, tokenizer = nli
    pipe = transformers.pipeline("zero-shot-classification", model=model, tokenizer=tokenizer, device="cpu")
    catalog = catalog_with(tmp_path, extract_card(directory, "test/nli", "zero_shot"))
    label_sets = [["politics", "technology", "food", "sports"], ["business"]]
    calls, expected = [], []
    for labels in label_sets:
        for template in (None, "The topic is {}."):
            calls.append(
                ExtractCall(
                    model="test/nli", items=TEXTS, labels=labels, multi_label=multi_label, hypothesis_template=template
                )
            )
            expected.append(
                [
                    pipe(
                        t,
                        candidate_labels=labels,
                        multi_label=multi_label,
                        hypothesis_template=template or "This example is {}.",
                    )
                    for t in TEXTS
                ]
            )
    for result, want in zip(run(catalog, *calls), expected):
        for item, exp in zip(result.items, want):
            assert [s.label for s in item.labels] == exp["labels"]
            np.testing.assert_allclose([s.score for s in item.labels], exp["scores"], atol=1e-4)
            assert item.entities is None and item.num_windows == 1


def test_zero_shot_cuts_a_long_text_and_says_so(tmp_path, nli):
    directory, model, tokenizer = nli
    pipe = transformers.pipeline("zero-shot-classification", model=model, tokenizer=tokenizer, device="cpu")
    catalog = catalog_with(tmp_path, extract_card(directory, "test/nli", "zero_shot", max_length=64))
    text = " ".join(TEXTS) * 6
    (result,) = run(catalog, ExtractCall(model="test/nli", items=[text, TEXTS[0]], labels=["politics", "food"]))
    assert result.items[0].truncated and not result.items[1].truncated
    pipe.tokenizer.model_max_length = 64
    exp = pipe(text, candidate_labels=["politics", "food"])
    np.testing.assert_allclose([s.score for s in result.items[0].labels], exp["scores"], atol=1e-4)


def test_bad_calls_are_refused_naming_the_problem(tmp_path, tagger, nli):
    directory, _, _ = tagger
    nli_dir = nli[0]
    catalog = catalog_with(
        tmp_path, extract_card(directory, "test/tagger", "token_class"), extract_card(nli_dir, "test/nli", "zero_shot")
    )
    nli_calls = {
        "labels is empty": dict(labels=[]),
        "more than one request may send": dict(labels=[f"l{i}" for i in range(101)]),
        "labels[1] is empty": dict(labels=["a", "  "]),
        "labels[0] is 201 characters": dict(labels=["x" * 201]),
        "threshold must be between 0 and 1": dict(labels=["a"], threshold=1.5),
        "hypothesis_template must contain {}": dict(labels=["a"], hypothesis_template="no slot"),
        "max_span_width applies to gliner": dict(labels=["a"], max_span_width=3),
        "aggregation applies to token_class": dict(labels=["a"], aggregation="first"),
        "flat_ner applies to gliner": dict(labels=["a"], flat_ner=False),
        "as a format string; got 'It is {{}}'": dict(labels=["a"], hypothesis_template="It is {{}}"),
    }
    calls = [ExtractCall(model="test/nli", items=["some text"], **kw) for kw in nli_calls.values()]
    calls.append(ExtractCall(model="test/tagger", items=["x"], aggregation="best"))
    calls.append(ExtractCall(model="test/nli", items=[], labels=["a"]))
    calls.append(ExtractCall(model="test/tagger", items=["x"], multi_label=True))
    results = run(catalog, *calls, catch=(InvalidRequest,))
    for expected, got in zip(
        [*nli_calls, "aggregation must be one of", "no items", "multi_label applies to gliner and"], results
    ):
        assert isinstance(got, InvalidRequest), (expected, got)
        assert expected in got.message, (expected, got.message)


def test_extract_cards_are_checked():
    base = {"id": "x/y", "source": {"hub": "x/y"}, "max_length": 512}
    with pytest.raises(CardError, match="extract"):
        parse_card({**base, "tasks": ["extract"]}, "card.yaml")
    with pytest.raises(CardError, match="extract"):
        parse_card({**base, "extract": {"kind": "gliner"}}, "card.yaml")
    with pytest.raises(CardError, match="hypothesis_template"):
        parse_card(
            {**base, "tasks": ["extract"], "extract": {"kind": "zero_shot", "hypothesis_template": "x"}}, "card.yaml"
        )
    with pytest.raises(CardError, match="threshold"):
        parse_card({**base, "tasks": ["extract"], "extract": {"kind": "gliner", "threshold": 2}}, "card.yaml")
    card = parse_card({**base, "tasks": ["extract"], "extract": {"kind": "token_class"}}, "card.yaml")
    assert card.extract.aggregation == "first"


def test_a_positional_template_is_filled_as_the_pipeline_fills_it(tmp_path, nli):
    directory, model, tokenizer = nli
    pipe = transformers.pipeline("zero-shot-classification", model=model, tokenizer=tokenizer, device="cpu")
    catalog = catalog_with(tmp_path, extract_card(directory, "test/nli", "zero_shot"))
    (result,) = run(
        catalog,
        ExtractCall(model="test/nli", items=TEXTS[:1], labels=["food", "sports"], hypothesis_template="About {0}."),
    )
    exp = pipe(TEXTS[0], candidate_labels=["food", "sports"], hypothesis_template="About {0}.")
    np.testing.assert_allclose([s.score for s in result.items[0].labels], exp["scores"], atol=1e-4)


def test_shoal_extract_prints_json_lines(tmp_path, tagger, capsys):
    from shoal.cli import main

    directory, _, _ = tagger
    cards = tmp_path / "cards"
    cards.mkdir()
    (cards / "tagger.yaml").write_text(extract_card(directory, "test/tagger", "token_class"))
    assert main(["extract", "--models-dir", str(cards), "test/tagger", TEXTS[0], TEXTS[1]]) == 0
    import json

    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["text"] for line in lines] == TEXTS[:2]
    assert all(TEXTS[i][e["start"] : e["end"]] == e["text"] for i, line in enumerate(lines) for e in line["entities"])
    assert main(["extract", "--models-dir", str(cards), "test/tagger", "x", "--label", "nope"]) == 2
    assert "does not tag 'nope'" in capsys.readouterr().err
