"""GLiNER span models: shoal's label prompt, word pooling, LSTM, span scoring and decoding against
the `gliner` library's `predict_entities` on the same random-initialised checkpoint (same entities,
scores <= 1e-4), flat and nested, single and multi-label, several label sets, two backbones and
both checkpoint layouts; long texts in word windows."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gliner")

from engine_calls import catalog_with, run
from extract_models import build_gliner, gliner_card
from shoal.engine import ExtractCall
from shoal.spans import owned_starts, split_words, word_windows

TEXTS = [
    "Barack Obama visited Paris with Angela Merkel in 2015 to meet the OECD.",
    "Apple Inc. hired Tim Cook 🍏 in Cupertino, California; shares rose 3.5% on the NASDAQ!",
    "Zürich-based Nestlé S.A. opened a café in São Paulo — its 12th in Brazil.",
    "The model ran on 2 cores; latency fell from 270 ms to 150 ms (p99).",
    "x",
]
LABEL_SETS = [
    ["person", "city", "organization"],
    ["person", "location", "date", "company", "money", "product"],
    ["country"],
]


def assert_same(expected: list[dict], got, where: str) -> None:
    assert [(e["start"], e["end"], e["label"]) for e in expected] == [(e.start, e.end, e.label) for e in got], where
    for e, g in zip(expected, got):
        assert g.text == e["text"]
        assert abs(g.score - e["score"]) <= 1e-4, (where, e, g)


@pytest.fixture(scope="module")
def deberta_gliner(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gliner") / "deberta"
    return directory, build_gliner(directory, "deberta-v3", seed=1)


@pytest.mark.parametrize("flat_ner,multi_label", [(True, False), (False, False), (True, True), (False, True)])
def test_entities_equal_gliner_predict_entities(tmp_path, deberta_gliner, flat_ner, multi_label):
    directory, reference = deberta_gliner
    catalog = catalog_with(tmp_path, gliner_card(directory))
    calls, expected = [], []
    for labels in LABEL_SETS:
        for threshold in (0.5, 0.9):
            calls.append(
                ExtractCall(
                    model="test/gliner",
                    items=TEXTS,
                    labels=labels,
                    threshold=threshold,
                    flat_ner=flat_ner,
                    multi_label=multi_label,
                )
            )
            expected.append(
                [
                    reference.predict_entities(
                        t, labels, threshold=threshold, flat_ner=flat_ner, multi_label=multi_label
                    )
                    for t in TEXTS
                ]
            )
    results = run(catalog, *calls)
    found = 0
    for call, result, want in zip(calls, results, expected):
        for i, (item, exp) in enumerate(zip(result.items, want)):
            assert_same(exp, item.entities, f"labels {call.labels} threshold {call.threshold} text {i}")
            found += len(exp)
    assert found > 50  # the comparison covers many entities, not empty lists


@pytest.mark.parametrize("layout", ["bert", "modernbert", "legacy", "legacy-spm"])
def test_bert_backbone_and_the_published_layout_equal_gliner(tmp_path, layout):
    """A BERT backbone (WordPiece, learned positions, a projection to a wider GLiNER hidden size,
    last-subtoken word pooling);
    and the layout of the published v2.1 checkpoints: no encoder_config, no tokenizer in the
    folder, the backbone's config and tokenizer found through the card's extract.backbone."""
    directory = tmp_path / "model"
    if layout == "bert":
        reference = build_gliner(directory, "bert", seed=5, hidden_size=48, subtoken_pooling="last")
        card = gliner_card(directory)
    elif layout == "modernbert":  # rotary positions, alternating local and global attention
        reference = build_gliner(directory, "modernbert", seed=5)
        card = gliner_card(directory)
    else:  # the legacy-spm backbone is as microsoft/deberta-v3-* ship: spm.model, no tokenizer.json
        if layout == "legacy-spm":
            pytest.importorskip("sentencepiece")
        backbone = "deberta-v3-spm" if layout == "legacy-spm" else "deberta-v3"
        reference = build_gliner(directory, backbone, seed=3, legacy_layout=True, embed_ent_token=False)
        card = gliner_card(directory, backbone=tmp_path / "model-backbone")
    catalog = catalog_with(tmp_path, card)
    labels = LABEL_SETS[1]
    (result,) = run(catalog, ExtractCall(model="test/gliner", items=TEXTS, labels=labels, threshold=0.5))
    total = 0
    for i, (item, text) in enumerate(zip(result.items, TEXTS)):
        expected = reference.predict_entities(text, labels, threshold=0.5)
        assert_same(expected, item.entities, f"text {i}")
        total += len(expected)
    assert total > 5


def test_marker_span_mode_with_one_word_spans_equals_gliner(tmp_path):
    """span_mode marker (NuNER Zero's layout: one-word spans, a linear out_project)."""
    directory = tmp_path / "model"
    reference = build_gliner(directory, "deberta-v3", seed=7, span_mode="marker", max_width=1)
    catalog = catalog_with(tmp_path, gliner_card(directory))
    labels = LABEL_SETS[1]
    (result,) = run(catalog, ExtractCall(model="test/gliner", items=TEXTS, labels=labels, threshold=0.3))
    total = 0
    for i, (item, text) in enumerate(zip(result.items, TEXTS)):
        expected = reference.predict_entities(text, labels, threshold=0.3)
        assert_same(expected, item.entities, f"text {i}")
        total += len(expected)
    assert total > 5


def nuner_merge(text: str, entities: list[dict]) -> list[dict]:
    """NuNER Zero's model card's `merge_entities`: consecutive entities of one label, next to each
    other or one character apart, become one (the first's score)."""
    merged = []
    for entity in entities:
        last = merged[-1] if merged else None
        if last and last["label"] == entity["label"] and entity["start"] in (last["end"], last["end"] + 1):
            last.update(end=entity["end"], text=text[last["start"] : entity["end"]].strip())
        else:
            merged.append(dict(entity))
    return merged


def test_nuner_zero_lowercases_labels_and_merges_adjacent_words(tmp_path):
    directory = tmp_path / "model"
    reference = build_gliner(directory, "deberta-v3", seed=7, span_mode="marker", max_width=1)
    catalog = catalog_with(tmp_path, gliner_card(directory, lowercase_labels="true", merge_adjacent="true"))
    labels = ["Person", "Location", "Organization"]
    (result,) = run(catalog, ExtractCall(model="test/gliner", items=TEXTS, labels=labels, threshold=0.2))
    merged_any = False
    for i, (item, text) in enumerate(zip(result.items, TEXTS)):
        raw = reference.predict_entities(text, [label.lower() for label in labels], threshold=0.2)
        expected = nuner_merge(text, raw)
        merged_any |= len(expected) < len(raw)
        for e in expected:
            e["label"] = labels[[label.lower() for label in labels].index(e["label"])]  # the labels as sent
        assert_same(expected, item.entities, f"text {i}")
    assert merged_any


def test_max_span_width_keeps_shorter_spans_only(tmp_path, deberta_gliner):
    directory, _ = deberta_gliner
    catalog = catalog_with(tmp_path, gliner_card(directory))
    wide, narrow = run(
        catalog,
        ExtractCall(model="test/gliner", items=TEXTS, labels=LABEL_SETS[1], threshold=0.3, flat_ner=False),
        ExtractCall(
            model="test/gliner", items=TEXTS, labels=LABEL_SETS[1], threshold=0.3, flat_ner=False, max_span_width=1
        ),
    )
    widths = [len(split_words(e.text)[0]) for item in wide.items for e in item.entities]
    assert max(widths) > 1
    assert all(len(split_words(e.text)[0]) == 1 for item in narrow.items for e in item.entities)


def long_text(num_words: int) -> tuple[str, dict[str, int]]:
    """Filler words with the same sentence at the start, the middle and the end."""
    sentence = "Angela Merkel met Barack Obama in Berlin ."
    filler = "the of report market data shows growth across several regions this year".split()
    words = [filler[i % len(filler)] for i in range(num_words)]
    places = {"start": 0, "middle": num_words // 2, "end": num_words - len(sentence.split())}
    for where in places.values():
        words[where : where + len(sentence.split())] = sentence.split()
    return " ".join(words), places


def test_a_5000_word_text_is_read_in_windows_and_merged(tmp_path, deberta_gliner):
    """Nothing is cut: the windows cover every word, and what each window reports for the spans it
    owns is what gliner finds on that window's text on its own (the reference run per window)."""
    directory, reference = deberta_gliner
    catalog = catalog_with(tmp_path, gliner_card(directory, max_words=300))
    text, places = long_text(5000)
    labels = ["person", "city"]
    threshold = 0.9
    (result,) = run(catalog, ExtractCall(model="test/gliner", items=[text], labels=labels, threshold=threshold))
    item = result.items[0]
    words, starts, ends = split_words(text)

    from shoal.engine.tokenizer import TextTokenizer
    from shoal.engine.tokenizer_files import load_tokenizer

    tok = TextTokenizer(load_tokenizer(directory), 512)
    prompt = [w for label in labels for w in ("<<ENT>>", label)] + ["<<SEP>>"]
    room = 512 - 2 - int(tok.word_token_counts(prompt).sum())
    windows = word_windows(np.minimum(tok.word_token_counts(words), room), room, 300, 64)
    assert item.num_windows == len(windows) >= 17 and windows[0][0] == 0 and windows[-1][1] == len(words)

    expected = []
    for (a, b), (lo, hi) in zip(windows, owned_starts(windows)):
        piece = text[starts[a] : ends[b - 1]]
        for e in reference.predict_entities(piece, labels, threshold=threshold):
            start = e["start"] + int(starts[a])
            if lo <= int(np.searchsorted(starts, start)) < hi:
                expected.append({**e, "start": start, "end": e["end"] + int(starts[a])})
    got = [(e.start, e.end, e.label) for e in item.entities]
    # Away from the cuts between windows, the merged entities are exactly each window's own (as
    # gliner decodes that window alone); near a cut the greedy decoding, which runs once over all
    # windows' candidates, may choose differently, so there only the scores of shared ones are compared.
    cuts = [lo for lo, _ in owned_starts(windows)[1:]]

    def far(start: int) -> bool:
        word = int(np.searchsorted(starts, start))
        return min(abs(word - c) for c in cuts) > 24

    by_key = {(e["start"], e["end"], e["label"]): e for e in expected}
    assert [k for k in got if far(k[0])] == [k for k in by_key if far(k[0])]
    for e in item.entities:
        if (e.start, e.end, e.label) in by_key:
            assert abs(e.score - by_key[(e.start, e.end, e.label)]["score"]) <= 1e-4
    assert all(text[e.start : e.end] == e.text for e in item.entities)
    assert len(got) == len(set(got))
    spans = sorted((e.start, e.end) for e in item.entities)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # flat: no overlaps across windows either
    for where, word in places.items():  # entities found at the start, in the middle and at the end
        lo, hi = starts[max(0, word - 30)], ends[min(word + 37, len(words) - 1)]
        assert any(lo <= e.start < hi for e in item.entities), where


def test_a_heavy_decoding_runs_beside_the_event_loop(tmp_path, deberta_gliner, monkeypatch):
    """Threshold 0 on a long text: every span is a candidate; decoding them runs in a worker
    thread (the event loop keeps serving), a small request's on the loop."""
    import threading

    from shoal.engine.tasks.extract_gliner import GlinerTask

    directory, _ = deberta_gliner
    catalog = catalog_with(tmp_path, gliner_card(directory))
    threads = []
    collect = GlinerTask.collect

    def spy(self, *args):
        threads.append(threading.current_thread() is threading.main_thread())
        return collect(self, *args)

    monkeypatch.setattr(GlinerTask, "collect", spy)
    heavy, light = run(
        catalog,
        ExtractCall(model="test/gliner", items=[long_text(600)[0]], labels=LABEL_SETS[1], threshold=0.0),
        ExtractCall(model="test/gliner", items=TEXTS[:1], labels=LABEL_SETS[0], threshold=0.9),
    )
    assert threads == [False, True]
    assert len(heavy.items[0].entities) > 100


def test_texts_without_words_and_a_word_longer_than_the_window(tmp_path, deberta_gliner):
    """An empty text, whitespace and punctuation; a 3,000-character word (its first tokens fill a
    window of its own, and the words around it are read once, not re-read around it)."""
    directory, reference = deberta_gliner
    catalog = catalog_with(tmp_path, gliner_card(directory))
    giant = "short words here " * 4 + "x" * 3000 + " Angela Merkel met Obama."
    texts = ["", "   \n\t ", "?! ...", giant]
    (result,) = run(catalog, ExtractCall(model="test/gliner", items=texts, labels=LABEL_SETS[0], threshold=0.5))
    empty, blank, punct, long = result.items
    assert empty.entities == [] and empty.num_windows == 0 and blank.entities == [] and blank.num_windows == 0
    assert punct.num_windows == 1
    assert [(e.start, e.end, e.label) for e in punct.entities] == [
        (e["start"], e["end"], e["label"]) for e in reference.predict_entities(texts[2], LABEL_SETS[0], threshold=0.5)
    ]
    assert long.num_windows == 3  # the words before it, the word alone, the words after it
    assert all(giant[e.start : e.end] == e.text for e in long.entities)


def test_a_word_the_tokenizer_drops_is_never_an_entity_edge(tmp_path):
    """BERT's normaliser drops a soft hyphen entirely: no token reads it, so no span starts or
    ends on it (gliner instead shifts every later word's vector by one)."""
    directory = tmp_path / "model"
    build_gliner(directory, "bert", seed=5, hidden_size=48)
    catalog = catalog_with(tmp_path, gliner_card(directory))
    text = "Angela Merkel \u00ad met Barack Obama \u00ad in Berlin"
    (result,) = run(
        catalog, ExtractCall(model="test/gliner", items=[text], labels=LABEL_SETS[1], threshold=0.1, flat_ner=False)
    )
    entities = result.items[0].entities
    assert entities
    soft = {i for i, ch in enumerate(text) if ch == "\u00ad"}
    assert all(e.start not in soft and e.end - 1 not in soft for e in entities)
