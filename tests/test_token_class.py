"""NER building block: `TokenClassHead` over shoal's packed encoder, then `spans.aggregate_entities`,
against transformers' token-classification pipeline on a random BertForTokenClassification with
MiniLM's WordPiece tokenizer, for every aggregation strategy."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers
from transformers.pipelines.token_classification import AggregationStrategy

from parity import attention_meta
from rerankers import minilm_dir
from shoal.engine.tokenizer import TextTokenizer
from shoal.heads import BuildContext
from shoal.heads.token_class import TokenClassHead
from shoal.layers import PackedInputs
from shoal.spans import STRATEGIES, aggregate_entities
from shoal.weights import build_model

BIO = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
# Labels without a B-/I- prefix ("LOC"), and one whose prefix is neither ("S-ORG").
MIXED = ["O", "B-PER", "I-PER", "LOC", "S-ORG", "B-ORG", "I-ORG"]
NON_ASCII = "Zürich und São Paulo: Ελλάδα, 東京 — naïve café in Genève, party😀! 🎉 Ünïcødé"
TEXTS = [
    "Angela Merkel met Emmanuel Macron in Paris, France, on Tuesday.",
    NON_ASCII,
    "Schwarzenegger's unbelievably hyperparameterized tokenization (U.S.A.) at Microsoft Inc.",
    "Dr. Ngozi Okonjo-Iweala visited the WTO... then Johannesburg; Kuala Lumpur!",
]


def save_token_classifier(directory, labels: list[str], seed: int = 3) -> None:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=30522,
        max_position_embeddings=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        id2label=dict(enumerate(labels)),
        label2id={k: i for i, k in enumerate(labels)},
    )
    model = transformers.BertForTokenClassification(config).eval()
    with torch.no_grad():  # logits of a few units, so labels vary from token to token
        model.classifier.weight.mul_(40.0)
        model.classifier.bias.copy_(torch.randn(len(labels)))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, directory / name)


def shoal_entities(directory, texts: list[str], strategy: str) -> list[list[dict]]:
    model = build_model(directory, None, "cpu")
    head = TokenClassHead.build(
        BuildContext(
            card=None, model=model, directory=directory, tokenizer=None, to={"device": "cpu", "dtype": torch.float32}
        )
    )
    encoded = TextTokenizer.from_dir(directory, 64).encode(texts, True, with_offsets=True)
    lengths = [len(e) for e in encoded]
    input_ids = torch.from_numpy(np.concatenate([e.ids for e in encoded]))  # [T]
    position_ids = torch.cat([torch.arange(n) for n in lengths])  # [T]
    inputs = PackedInputs(input_ids, position_ids, attention_meta(lengths))
    with torch.inference_mode():
        logits = head.logits(model(inputs)).numpy()  # [T, labels]
    out, start = [], 0
    for text, e in zip(texts, encoded):
        out.append(
            aggregate_entities(logits[start : start + len(e)], head.id2label, e.offsets, e.word_ids, text, strategy)
        )
        start += len(e)
    return out


def pipeline_entities(directory, texts: list[str], strategy: str) -> list[list[dict]]:
    pipe = transformers.pipeline(
        "token-classification", model=str(directory), aggregation_strategy=strategy, device="cpu"
    )
    return [pipe(t) for t in texts]


def assert_same(got: list[dict], expected: list[dict], text: str) -> None:
    assert [(g["label"], g["start"], g["end"]) for g in got] == [
        (e["entity_group"], e["start"], e["end"]) for e in expected
    ], text
    assert [g["text"] for g in got] == [text[e["start"] : e["end"]] for e in expected]
    for g, e in zip(got, expected):
        assert abs(g["score"] - float(e["score"])) <= 1e-4, (g, e)


@pytest.fixture(scope="module")
def bio_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ner")
    save_token_classifier(directory, BIO)
    return directory


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_entities_equal_transformers_pipeline_for_each_strategy(bio_model, strategy):
    expected = pipeline_entities(bio_model, TEXTS, strategy)
    got = shoal_entities(bio_model, TEXTS, strategy)
    for text, g, e in zip(TEXTS, got, expected):
        assert_same(g, e, text)
    assert sum(map(len, got)) > 0  # the comparison is not between two empty lists


def test_unprefixed_labels_group_as_the_pipeline_groups_them(tmp_path):
    save_token_classifier(tmp_path, MIXED, seed=5)
    for strategy in STRATEGIES:
        expected = pipeline_entities(tmp_path, TEXTS, strategy)
        got = shoal_entities(tmp_path, TEXTS, strategy)
        for text, g, e in zip(TEXTS, got, expected):
            assert_same(g, e, text)
        assert sum(map(len, got)) > 0


def test_hand_set_tag_sequences_match_pipeline_postprocess(bio_model):
    """Chosen label sequences (I- without B-, B- after B-, runs of I-, unprefixed and S- labels) on
    top of random noise, through the pipeline's own postprocessing and through aggregate_entities."""
    id2label = dict(enumerate(MIXED))
    pipe = transformers.pipeline("token-classification", model=str(bio_model), device="cpu")
    pipe.model.config.id2label = id2label
    tokenizer = TextTokenizer.from_dir(bio_model, 64)
    pattern = [2, 2, 1, 1, 2, 0, 3, 3, 4, 6, 5, 6, 0, 2, 6, 3, 1, 4, 4]  # indices into MIXED
    rng = np.random.default_rng(0)
    found = 0
    for text in TEXTS:
        inputs = pipe.tokenizer(text, return_tensors="pt", return_special_tokens_mask=True, return_offsets_mapping=True)
        n = inputs["input_ids"].shape[1]
        logits = rng.normal(size=(n, len(MIXED))).astype(np.float32)
        logits[np.arange(n), [pattern[i % len(pattern)] for i in range(n)]] += 3.0
        [encoded] = tokenizer.encode([text], True, with_offsets=True)
        assert encoded.ids.tolist() == inputs["input_ids"][0].tolist()
        for strategy in STRATEGIES:
            outputs = {
                "logits": torch.from_numpy(logits)[None],
                "input_ids": inputs["input_ids"],
                "offset_mapping": inputs["offset_mapping"],
                "special_tokens_mask": inputs["special_tokens_mask"],
                "sentence": text,
                "is_last": True,
                "word_ids": None,
                "word_to_chars_map": None,
            }
            expected = pipe.postprocess([outputs], aggregation_strategy=AggregationStrategy(strategy))
            got = aggregate_entities(logits, id2label, encoded.offsets, encoded.word_ids, text, strategy)
            assert_same(got, expected, text)
            found += len(got)
    assert found > 0


def test_entity_text_is_the_slice_of_non_ascii_text(bio_model):
    for strategy in STRATEGIES:
        [entities] = shoal_entities(bio_model, [NON_ASCII], strategy)
        assert entities, strategy
        for e in entities:
            assert NON_ASCII[e["start"] : e["end"]] == e["text"] and e["text"].strip()


@pytest.mark.parametrize("seed", range(20))
def test_word_windows_cover_fit_and_own_every_start_once(seed):
    """Random token counts (some words longer than a window): the windows cover every word in
    order, each fits (a word alone always does), overlaps are at most the asked words and half a
    window, no window is inside the one before, and the owned starts split the words exactly once
    each, inside their own window."""
    from shoal.spans import owned_starts, word_windows

    rng = np.random.default_rng(seed)
    n, room, max_words, overlap = (
        int(rng.integers(1, 400)),
        int(rng.integers(8, 60)),
        int(rng.integers(2, 50)),
        int(rng.integers(0, 20)),
    )
    counts = np.minimum(rng.choice([1, 1, 1, 2, 3, 90], size=n), room)
    windows = word_windows(counts, room, max_words, overlap)
    assert windows[0][0] == 0 and windows[-1][1] == n
    for a, b in windows:
        assert b > a and b - a <= max_words and (b - a == 1 or counts[a:b].sum() <= room)
    for (a0, b0), (a1, b1) in zip(windows, windows[1:]):
        assert a0 < a1 <= b0 < b1 and b0 - a1 <= min(overlap, (b0 - a0) // 2)
    owned = owned_starts(windows)
    assert owned[0][0] == 0 and owned[-1][1] == n
    assert all(lo1 == hi0 for (_, hi0), (lo1, _) in zip(owned, owned[1:]))
    assert all(a <= lo <= hi <= b for (a, b), (lo, hi) in zip(windows, owned))
