"""A text classifier (extract kind classify) through the SDK and the batch CLI, against a real
server: both give the labels and scores transformers' text-classification pipeline gives, with
`top_k`, `raw_scores` and (SDK) `text_pairs` chunked alongside their texts."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from extract_models import spread, wordpiece_tokenizer
from shoal.cli import main
from shoal.sdk import Client
from test_classify import PAIRS, SENTIMENT, TEXTS, _bert

MODEL = "test/sentiment-clients"


@pytest.fixture(scope="module")
def sentiment(serve, tmp_path_factory):
    """(text-classification pipeline, server URL) of a random 3-label BERT classifier."""
    root = tmp_path_factory.mktemp("sentiment")
    tokenizer = wordpiece_tokenizer(root / "weights")
    torch.manual_seed(1)
    model = _bert(tokenizer, SENTIMENT).eval()
    spread(model, 5)
    model.save_pretrained(root / "weights")
    (root / "cards").mkdir()
    card = {
        "id": MODEL,
        "tasks": ["extract"],
        "extract": {"kind": "classify"},
        "source": {"path": str(root / "weights")},
    }
    (root / "cards" / "sentiment.yaml").write_text(json.dumps({**card, "max_length": 128}))
    pipe = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, device="cpu")
    return pipe, serve(cards_dirs=(root / "cards",), preload=(MODEL,))


def labelled(items) -> list[list[tuple[str, float]]]:
    return [[(label.label, label.score) for label in item.labels] for item in items]


def wanted(answers) -> list[list[tuple[str, float]]]:
    return [[(a["label"], a["score"]) for a in answer] for answer in answers]


def close(got, want) -> None:
    assert [[label for label, _ in row] for row in got] == [[label for label, _ in row] for row in want]
    for row, ref in zip(got, want):
        assert [s for _, s in row] == pytest.approx([s for _, s in ref], abs=1e-5)


def test_the_sdk_classifies_texts_and_pairs_in_chunks_as_the_pipeline_does(sentiment):
    pipe, url = sentiment
    with Client(url) as client:
        best = client.extract(MODEL, TEXTS, top_k=2, batch_size=3)
        raw = client.extract(MODEL, TEXTS, raw_scores=True)
        sigmoid = client.extract(MODEL, TEXTS, function_to_apply="sigmoid")
        pairs = client.extract(MODEL, TEXTS, text_pairs=PAIRS, batch_size=3)
        with pytest.raises(ValueError, match="text_pairs"):
            client.extract(MODEL, TEXTS, text_pairs=PAIRS[:2])
    close(labelled(best), wanted(pipe(TEXTS, top_k=2)))
    close(labelled(raw), wanted(pipe(TEXTS, top_k=None, function_to_apply="none")))
    close(labelled(sigmoid), wanted(pipe(TEXTS, top_k=None, function_to_apply="sigmoid")))
    inputs = [{"text": t, "text_pair": p} for t, p in zip(TEXTS, PAIRS)]
    close(labelled(pairs), wanted(pipe(inputs, top_k=None)))


def test_the_batch_cli_writes_each_texts_top_labels(sentiment, capsys):
    pipe, url = sentiment
    assert main(["extract", MODEL, *TEXTS[:2], "--url", url, "--top-k", "1", "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["text"] for row in rows] == TEXTS[:2]
    got = [[(label["label"], label["score"]) for label in row["labels"]] for row in rows]
    close(got, wanted(pipe(TEXTS[:2], top_k=1)))
