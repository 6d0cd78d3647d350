"""The Hugging Face Inference API's zero-shot classification body on `POST /`, sent by
`huggingface_hub`'s `InferenceClient.zero_shot_classification`, served by a GLiClass model and by a
GLiNER2 model (random weights): every candidate label's score, best first, against the `gliclass`
package's ZeroShotClassificationPipeline and the `gliner2` package's `classify_text` (one task over
the labels) on the same folders; the kinds' refusals, and the OpenAPI document's example of the body.
(The NLI kind's answer is tested in test_peer_routes.py.)"""

from __future__ import annotations

import httpx
import jsonschema
import pytest

pytest.importorskip("gliclass")
pytest.importorskip("gliner2")

from extract_models import extract_card
from test_gliclass import build_gliclass
from test_gliclass import pipeline as gliclass_pipeline
from test_gliner2 import build_gliner2
from test_gliner2 import card as gliner2_card

GLICLASS = "test/zs-gliclass"
GLINER2 = "test/zs-gliner2"
TEXTS = [
    "The striker scored twice as the home team won the league title on Sunday.",
    "Zürich-based Nestlé S.A. opened a café in São Paulo — its 12th in Brazil 🍫.",
]
LABELS = ["sports", "politics", "economy", "food and travel"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(cards folder, the gliclass pipeline's (model, tokenizer), the gliner2 package's model)."""
    root = tmp_path_factory.mktemp("zero-shot")
    gliclass = build_gliclass(root / "gliclass", seed=5, scorer_type="weighted-dot")
    gliner2 = build_gliner2(root / "gliner2", seed=6, counting_layer="count_lstm_v2")
    cards = root / "cards"
    cards.mkdir()
    (cards / "gliclass.yaml").write_text(extract_card(root / "gliclass", GLICLASS, "gliclass"))
    (cards / "gliner2.yaml").write_text(gliner2_card(root / "gliner2", GLINER2))
    return cards, gliclass, gliner2


@pytest.fixture(scope="module")
def url(serve, built) -> str:
    """MiniLM (an embedder) and both zero-shot models preloaded."""
    from conftest import MODEL_ID

    return serve(preload=(MODEL_ID, GLICLASS, GLINER2), cards_dirs=(built[0],))


@pytest.fixture
def hf(url, monkeypatch):
    """The client as a user runs it; HF_HUB_OFFLINE is lifted for this loopback server only."""
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    return lambda model: InferenceClient(model=url, headers={"x-shoal-model": model}, timeout=120)


def same(got, want: dict[str, float], where: str) -> None:
    """Every label once, with the reference's score, best first."""
    assert sorted(e.label for e in got) == sorted(want), where
    for e in got:
        assert abs(e.score - want[e.label]) <= ATOL, (where, e.label, e.score, want[e.label])
    assert [e.score for e in got] == sorted((e.score for e in got), reverse=True), where


@pytest.mark.parametrize("multi_label", [False, True])
def test_huggingface_hub_zero_shot_on_a_gliclass_model_equals_the_gliclass_pipeline(hf, built, multi_label):
    kind = "multi-label" if multi_label else "single-label"
    pipe = gliclass_pipeline(built[1], kind)
    client = hf(GLICLASS)
    for i, text in enumerate(TEXTS):
        got = client.zero_shot_classification(text, LABELS, multi_label=multi_label)
        # Every label's score: the pipeline's full score map (its single-label answer is the best only).
        (scores,) = pipe([text], LABELS, threshold=0.0, return_hierarchical=True)
        same(got, scores, f"text {i}")
        (answer,) = pipe([text], LABELS, threshold=0.0)  # the best label (single-label), else every one
        assert got[0].label == max(answer, key=lambda a: a["score"])["label"]
        if multi_label:
            assert len(answer) == len(got) and len({round(e.score, 3) for e in got}) > 1
        else:
            assert abs(sum(e.score for e in got) - 1.0) <= 1e-5


@pytest.mark.parametrize("multi_label", [False, True])
def test_huggingface_hub_zero_shot_on_a_gliner2_model_equals_a_gliner2_classification_task(hf, built, multi_label):
    """One task over the candidate labels, every label answered: softmax across them (single-label)
    or each one's sigmoid, as gliner2's classify_text scores them with that activation."""
    from shoal.wire.hf import ZERO_SHOT_TASK

    reference = built[2]
    task = {"labels": LABELS, "multi_label": True, "cls_threshold": 0.0}
    task["class_act"] = "sigmoid" if multi_label else "softmax"
    client = hf(GLINER2)
    for i, text in enumerate(TEXTS):
        got = client.zero_shot_classification(text, LABELS, multi_label=multi_label)
        want = reference.classify_text(text, {ZERO_SHOT_TASK: task}, include_confidence=True)[ZERO_SHOT_TASK]
        same(got, {w["label"]: w["confidence"] for w in want}, f"text {i}")
        if not multi_label:
            assert abs(sum(e.score for e in got) - 1.0) <= 1e-5


@pytest.mark.parametrize(
    "model, parameters, status, words",
    [
        (GLICLASS, {"hypothesis_template": "It is about {}."}, 400, "hypothesis_template applies to zero_shot"),
        (GLINER2, {"hypothesis_template": "It is about {}."}, 400, "hypothesis_template applies to zero_shot"),
        (GLINER2, {"candidate_labels": ["a", "a"]}, 400, "repeats a label"),
        ("sentence-transformers/all-MiniLM-L6-v2", {}, 400, "is not a zero-shot classifier"),
    ],
)
def test_a_zero_shot_body_a_model_cannot_answer_is_a_4xx_saying_why(url, model, parameters, status, words):
    body = {"inputs": TEXTS[0], "parameters": {"candidate_labels": LABELS, **parameters}}
    response = httpx.post(f"{url}/?model={model}", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_two_zero_shot_models_preloaded_make_a_body_without_a_model_name_one(url):
    body = {"inputs": TEXTS[0], "parameters": {"candidate_labels": LABELS}}
    response = httpx.post(f"{url}/", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["details"]["candidates"] == [GLICLASS, GLINER2]


def test_the_documents_zero_shot_example_fits_its_schema_and_a_gliclass_model_answers_it(url):
    document = httpx.get(f"{url}/openapi.json").json()
    operation = document["paths"]["/"]["post"]
    request = operation["requestBody"]["content"]["application/json"]
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
    body = request["examples"]["zero_shot"]["value"]
    jsonschema.validate(body, {**request["schema"], "components": document["components"]})
    response = httpx.post(f"{url}/?model={GLICLASS}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert [e["label"] for e in response.json()] != [] and len(response.json()) == 3
    jsonschema.validate(response.json(), {**answer, "components": document["components"]})
