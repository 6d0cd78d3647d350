"""/v1/extract over real HTTP on the real engine: a GLiNER model (entities equal to the gliner
library's, computed here), a token classifier and a zero-shot classifier, in JSON and msgpack;
offsets that slice the original text (non-ASCII and emoji); windows merged; bad input is a 4xx
that names the problem."""

from __future__ import annotations

import httpx
import msgspec
import pytest

pytest.importorskip("gliner")

from extract_models import build_gliner, build_nli, build_token_classifier, extract_card, gliner_card

TEXTS = [
    "Angela Merkel 🇩🇪 met Barack Obama in Berlin; 东京 and São Paulo sent envoys 🎉 too.",
    "Apple Inc. hired Tim Cook 🍏 in Cupertino, California!",
    "naïve café owners in Zürich — ☕ — said “no”.",
]
LABELS = ["person", "city", "organization"]
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("extract-http")
    reference = build_gliner(root / "gliner", "deberta-v3", seed=1)
    build_token_classifier(root / "tagger", seed=3)
    build_nli(root / "nli", ["contradiction", "entailment", "neutral"], seed=4)
    cards = root / "cards"
    cards.mkdir()
    (cards / "gliner.yaml").write_text(gliner_card(root / "gliner", max_words=40))
    (cards / "tagger.yaml").write_text(extract_card(root / "tagger", "test/tagger", "token_class"))
    (cards / "nli.yaml").write_text(extract_card(root / "nli", "test/nli", "zero_shot"))
    return cards, reference


@pytest.fixture(scope="module")
def url(serve, models):
    return serve(preload=("test/gliner",), cards_dirs=(models[0],))


def post(url: str, body: dict, msgpack: bool = False) -> httpx.Response:
    if msgpack:
        return httpx.post(
            f"{url}/v1/extract",
            content=msgspec.msgpack.encode(body),
            timeout=120,
            headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
        )
    return httpx.post(f"{url}/v1/extract", json=body, timeout=120)


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_gliner_entities_over_http_equal_the_library(url, models, msgpack):
    reference = models[1]
    body = {
        "model": "test/gliner",
        "labels": LABELS,
        "items": [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)],
        "options": {"threshold": 0.3},
    }
    response = post(url, body, msgpack)
    assert response.status_code == 200, response.text
    out = msgspec.msgpack.decode(response.content) if msgpack else response.json()
    assert response.headers["content-type"].startswith("application/msgpack" if msgpack else "application/json")
    total = 0
    for i, (item, text) in enumerate(zip(out["items"], TEXTS)):
        assert item["id"] == f"t{i}" and item["index"] == i
        expected = reference.predict_entities(text, LABELS, threshold=0.3)
        assert [(e["start"], e["end"], e["label"]) for e in item["entities"]] == [
            (e["start"], e["end"], e["label"]) for e in expected
        ]
        for e, x in zip(item["entities"], expected):
            assert text[e["start"] : e["end"]] == e["text"] == x["text"]
            assert abs(e["score"] - x["score"]) <= 1e-4
        total += len(expected)
    assert total > 5
    assert any(ord(c) > 0xFFFF for item in out["items"] for e in item["entities"] for c in e["text"]) or any(
        e["start"] > TEXTS[0].index("🇩🇪") for e in out["items"][0]["entities"]
    )  # offsets past an emoji
    assert out["usage"]["tokens"] > 0 and out["timings"]["total_ms"] > 0


def test_a_long_text_over_http_is_read_in_windows(url):
    text = " ".join(TEXTS * 30)
    response = post(url, {"model": "test/gliner", "labels": LABELS, "items": [{"text": text}]})
    assert response.status_code == 200, response.text
    item = response.json()["items"][0]
    assert item["num_windows"] > 5
    assert all(text[e["start"] : e["end"]] == e["text"] for e in item["entities"])
    assert max(e["end"] for e in item["entities"]) > 0.9 * len(text)


def test_token_class_and_zero_shot_over_http(url):
    tagged = post(
        url, {"model": "test/tagger", "items": [{"text": t} for t in TEXTS], "options": {"aggregation": "simple"}}
    )
    assert tagged.status_code == 200, tagged.text
    for item, text in zip(tagged.json()["items"], TEXTS):
        assert all(text[e["start"] : e["end"]] == e["text"] for e in item["entities"])
        assert "labels" not in item
    classified = post(
        url,
        {
            "model": "test/nli",
            "labels": ["politics", "food", "tech"],
            "items": [{"text": TEXTS[0]}],
            "options": {"multi_label": True, "hypothesis_template": "It is about {}."},
        },
        msgpack=True,
    )
    assert classified.status_code == 200
    item = msgspec.msgpack.decode(classified.content)["items"][0]
    scores = [s["score"] for s in item["labels"]]
    assert sorted(s["label"] for s in item["labels"]) == ["food", "politics", "tech"] and scores == sorted(scores)[::-1]
    assert "entities" not in item


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ({"labels": []}, 400, "labels is empty"),
        ({}, 400, "labels is empty"),
        ({"labels": [f"l{i}" for i in range(101)]}, 400, "more than one request may send (100)"),
        ({"labels": ["person", ""]}, 400, "labels[1] is empty"),
        ({"labels": ["x" * 300]}, 400, "labels[0] is 300 characters long"),
        ({"labels": ["person"], "options": {"threshold": 1.5}}, 400, "threshold must be between 0 and 1"),
        ({"labels": ["person"], "options": {"threshold": -0.1}}, 400, "threshold must be between 0 and 1"),
        ({"labels": ["person"], "options": {"max_span_width": 40}}, 400, "wider than the model's spans (12 words)"),
        ({"labels": ["person"], "options": {"aggregation": "first"}}, 400, "aggregation applies to token_class"),
        ({"labels": ["person"], "options": {"colour": 1}}, 400, "colour"),
        ({"labels": "person"}, 400, "labels"),
        ({"labels": ["<<SEP>>"]}, 400, "one of the model's prompt tokens"),
        (
            {"labels": [f"a rather long entity type description number {i}" for i in range(60)]},
            400,
            "leaving too little for the text",
        ),
        ({"labels": ["person"], "items": []}, 400, "items"),
    ],
)
def test_bad_extract_requests_are_4xx_naming_the_problem(url, body, status, needle):
    full = {"model": "test/gliner", "items": [{"text": "Angela Merkel met Obama."}], **body}
    response = post(url, full)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"], response.json()


def test_extract_on_a_model_that_cannot_lists_its_tasks(url):
    response = post(url, {"model": MODEL_ID, "labels": ["person"], "items": [{"text": "hello"}]})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "does not extract" in message and "encode" in message and "score" in message
    unknown = post(url, {"model": "nobody/none", "labels": ["x"], "items": [{"text": "hello"}]})
    assert unknown.status_code == 404
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert listed["test/gliner"]["tasks"] == ["extract"] and listed["test/gliner"]["extract"] == "gliner"
    assert listed["test/nli"]["extract"] == "zero_shot" and "extract" not in listed[MODEL_ID]
