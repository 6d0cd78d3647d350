"""The peers' text-classification routes on a real server, over a random BERT sentiment classifier
(extract kind classify), each answer checked against transformers' text-classification pipeline on
the same weights:

- TEI's `POST /predict` (`inputs`: a text, `[text]`, a pair `[text, text_pair]`, or a batch of such
  lists; `raw_scores`; `truncate`), and `POST /` with its body, as TEI serves a classifier there;
- Infinity's `POST /classify` (`{"model"?, "input": [str], "raw_scores"?}` -> `{"object": "classify",
  "data": [[{"score", "label"}]], ...}`);
- the Hugging Face Inference API's text-classification body on `POST /`, sent by
  `huggingface_hub`'s `InferenceClient.text_classification` (`top_k`, `function_to_apply`);
- each route's bodies against the OpenAPI document's schemas, and the refusals.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch
import transformers

from conftest import MODEL_ID
from extract_models import build_token_classifier, extract_card, spread, wordpiece_tokenizer
from test_classify import PAIRS, SENTIMENT, TEXTS, _bert

CLASSIFIER = "test/predict-sentiment"
TAGGER = "test/predict-tagger"
MAX_LENGTH = 64
LONG = " ".join(["the film was long"] * 40)  # over MAX_LENGTH tokens
ATOL = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(cards folder, the text-classification pipeline on the classifier's weights)."""
    root = tmp_path_factory.mktemp("predict")
    tokenizer = wordpiece_tokenizer(root / "classifier")
    torch.manual_seed(7)
    model = _bert(tokenizer, SENTIMENT).eval()
    spread(model, 7)
    model.save_pretrained(root / "classifier")
    build_token_classifier(root / "tagger", seed=2)
    cards = root / "cards"
    cards.mkdir()
    card = {
        "id": CLASSIFIER,
        "tasks": ["extract"],
        "extract": {"kind": "classify"},
        "source": {"path": str(root / "classifier")},
        "max_length": MAX_LENGTH,
    }
    (cards / "classifier.yaml").write_text(json.dumps(card))  # JSON is YAML
    (cards / "tagger.yaml").write_text(extract_card(root / "tagger", TAGGER, "token_class"))
    return cards, transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, device="cpu")


@pytest.fixture(scope="module")
def url(serve, built) -> str:
    """MiniLM (an embedder) and the classifier preloaded."""
    return serve(preload=(MODEL_ID, CLASSIFIER), cards_dirs=(built[0],))


@pytest.fixture(scope="module")
def extract_only_url(serve, built) -> str:
    """The classifier and a token tagger preloaded, no embedder."""
    return serve(preload=(CLASSIFIER, TAGGER), cards_dirs=(built[0],))


@pytest.fixture(scope="module")
def pipe(built):
    return built[1]


def scored(answer: list[dict]) -> list[tuple[str, float]]:
    return [(entry["label"], entry["score"]) for entry in answer]


def same(got: list[tuple[str, float]], want: list[dict]) -> None:
    """The reference's labels in its order, with its scores."""
    assert [label for label, _ in got] == [w["label"] for w in want]
    assert [score for _, score in got] == pytest.approx([w["score"] for w in want], abs=ATOL)


def post(base: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60, **kwargs)


# --- TEI /predict -----------------------------------------------------------------------------


def test_predict_answers_a_text_a_one_text_list_and_a_pair_with_every_label_best_first(url, pipe):
    one = post(url, "/predict", {"inputs": TEXTS[0]})
    assert one.status_code == 200, one.text
    assert one.headers["x-shoal-model"] == CLASSIFIER
    assert list(one.json()[0]) == ["score", "label"]  # TEI's field order
    same(scored(one.json()), pipe(TEXTS[0], top_k=None))
    same(scored(post(url, "/predict", {"inputs": [TEXTS[1]]}).json()), pipe(TEXTS[1], top_k=None))
    pair = post(url, "/predict", {"inputs": [TEXTS[2], PAIRS[2]]}).json()
    same(scored(pair), pipe({"text": TEXTS[2], "text_pair": PAIRS[2]}, top_k=None))


def test_predict_answers_a_batch_of_texts_and_pairs_in_order_with_a_list_each(url, pipe):
    singles = post(url, "/predict", {"inputs": [[t] for t in TEXTS]}).json()
    assert len(singles) == len(TEXTS)
    for got, want in zip(singles, pipe(TEXTS, top_k=None)):
        same(scored(got), want)
    pairs = post(url, "/predict", {"inputs": [[t, p] for t, p in zip(TEXTS, PAIRS)]}).json()
    for got, want in zip(pairs, pipe([{"text": t, "text_pair": p} for t, p in zip(TEXTS, PAIRS)], top_k=None)):
        same(scored(got), want)
    mixed = post(url, "/predict", {"inputs": [[TEXTS[0]], [TEXTS[1], PAIRS[1]], [TEXTS[2]]]}).json()
    wants = [pipe(TEXTS[0], top_k=None), pipe({"text": TEXTS[1], "text_pair": PAIRS[1]}, top_k=None)]
    for got, want in zip(mixed, [*wants, pipe(TEXTS[2], top_k=None)], strict=True):
        same(scored(got), want)


def test_predict_raw_scores_are_the_pipelines_logits(url, pipe):
    raw = post(url, "/predict", {"inputs": [[TEXTS[0]], [TEXTS[3], PAIRS[3]]], "raw_scores": True}).json()
    same(scored(raw[0]), pipe(TEXTS[0], top_k=None, function_to_apply="none"))
    same(scored(raw[1]), pipe({"text": TEXTS[3], "text_pair": PAIRS[3]}, top_k=None, function_to_apply="none"))
    assert any(score < 0 or score > 1 for _, score in scored(raw[0]))  # logits, not probabilities


def test_predict_refuses_an_over_long_text_unless_truncate_and_then_says_which_it_cut(url, pipe):
    refused = post(url, "/predict", {"inputs": LONG, "truncate": False})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == "input_too_long"
    assert post(url, "/predict", {"inputs": LONG}).status_code == 422  # TEI's default: truncate false
    cut = post(url, "/predict", {"inputs": [[TEXTS[0], PAIRS[0]], [LONG], [TEXTS[1]]], "truncate": True})
    assert cut.status_code == 200, cut.text
    assert cut.headers["x-shoal-truncated"] == "1"  # the batch's index, though it ran in a call of its own
    same(scored(cut.json()[1]), pipe(LONG, top_k=None, truncation=True, max_length=MAX_LENGTH))


@pytest.mark.parametrize(
    "body, words",
    [
        ({"inputs": TEXTS[:3]}, "list of 3 strings"),  # TEI's rule: a list of strings is one text or a pair
        ({"inputs": [[TEXTS[0]], TEXTS[1]]}, "mixes strings and lists"),
        ({"inputs": []}, "$.inputs"),
        ({"inputs": [["a", "b", "c"]]}, "$.inputs[0]"),
        ({"inputs": "a", "truncation_direction": "Left"}, "truncation_direction"),
        ({"inputs": "a", "top_k": 1}, "top_k"),
        ({"raw_scores": True}, "inputs"),
    ],
)
def test_a_bad_predict_body_is_a_400_naming_the_field(url, body, words):
    response = post(url, "/predict", body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_predict_on_a_model_that_is_no_classifier_is_a_400_saying_what_it_serves(url, extract_only_url):
    response = post(url, f"/predict?model={MODEL_ID}", {"inputs": "a"})
    assert response.status_code == 400
    assert (
        response.json()["error"]["message"]
        == f"model {MODEL_ID} is not a text classifier (extract kind classify); it serves: encode, score"
    )
    tagger = post(extract_only_url, "/predict", {"inputs": "a"}, headers={"x-shoal-model": TAGGER})
    assert tagger.status_code == 400 and "extract kind token_class" in tagger.json()["error"]["message"]


def test_root_predicts_as_tei_does_for_a_classifier_and_still_embeds_for_an_embedder(url, extract_only_url, pipe):
    embedded = post(url, "/", {"inputs": TEXTS[0]})
    assert embedded.headers["x-shoal-model"] == MODEL_ID and len(embedded.json()[0]) == 384
    named = post(url, f"/?model={CLASSIFIER}", {"inputs": [TEXTS[0], PAIRS[0]]})
    same(scored(named.json()), pipe({"text": TEXTS[0], "text_pair": PAIRS[0]}, top_k=None))
    batch = post(url, "/", {"inputs": [[TEXTS[1]]]})  # a batch of lists is no embed body
    assert batch.headers["x-shoal-model"] == CLASSIFIER
    same(scored(batch.json()[0]), pipe(TEXTS[1], top_k=None))
    raw = post(url, "/", {"inputs": TEXTS[2], "raw_scores": True})
    same(scored(raw.json()), pipe(TEXTS[2], top_k=None, function_to_apply="none"))
    # No embedder preloaded: the classifier answers `/`, as on a TEI serving one.
    only = post(extract_only_url, "/", {"inputs": TEXTS[3]})
    assert only.headers["x-shoal-model"] == CLASSIFIER
    same(scored(only.json()), pipe(TEXTS[3], top_k=None))


# --- TEI /info ------------------------------------------------------------------------------------


def test_info_reports_the_classifiers_labels_as_tei_does(url, extract_only_url, pipe):
    """TEI's `model_type: {"classifier": {id2label, label2id}}`, the labels the model's config names;
    a server with a classifier and no embedder answers `/info` for the classifier, as TEI does."""
    config = pipe.model.config
    want = {
        "classifier": {
            "id2label": {str(i): label for i, label in config.id2label.items()},
            "label2id": {label: i for i, label in config.id2label.items()},
        }
    }
    assert sorted(config.id2label.values()) == sorted(SENTIMENT)  # the config's own names, not LABEL_i
    named = httpx.get(f"{url}/info", params={"model": CLASSIFIER}).json()
    assert named["model_id"] == CLASSIFIER and named["model_type"] == want
    assert named["max_input_length"] == MAX_LENGTH
    only = httpx.get(f"{extract_only_url}/info")
    assert only.status_code == 200, only.text
    assert only.json()["model_id"] == CLASSIFIER and only.json()["model_type"] == want
    embedder = httpx.get(f"{url}/info").json()  # an embedder preloaded: /info is still its
    assert embedder["model_id"] == MODEL_ID and "embedding" in embedder["model_type"]


def test_the_documents_info_example_is_a_classifiers(url):
    document = httpx.get(f"{url}/openapi.json").json()
    example = document["paths"]["/info"]["get"]["responses"]["200"]["content"]["application/json"]["example"]
    served = httpx.get(f"{url}/info", params={"model": CLASSIFIER}).json()
    assert set(example) == set(served)
    assert list(example["model_type"]) == ["classifier"]
    assert set(example["model_type"]["classifier"]) == {"id2label", "label2id"}


def test_the_documents_text_classification_example_on_root_is_the_pipelines_answer(url, pipe):
    document = httpx.get(f"{url}/openapi.json").json()
    body = document["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["examples"]
    example = body["text_classification"]["value"]
    response = post(url, f"/?model={CLASSIFIER}", example)
    assert response.status_code == 200, response.text
    same(scored(response.json()[0]), pipe(example["inputs"], top_k=example["parameters"]["top_k"]))


# --- Infinity /classify -------------------------------------------------------------------------


def test_infinity_classify_answers_each_texts_labels_in_infinitys_shape(url, pipe):
    response = post(url, "/classify", {"input": TEXTS})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "classify" and answer["model"] == CLASSIFIER
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > len(TEXTS)
    assert isinstance(answer["id"], str) and isinstance(answer["created"], int)
    for got, want in zip(answer["data"], pipe(TEXTS, top_k=None), strict=True):
        same(scored(got), want)
    raw = post(url, "/classify", {"model": CLASSIFIER, "input": TEXTS[:1], "raw_scores": True}).json()
    same(scored(raw["data"][0]), pipe(TEXTS[0], top_k=None, function_to_apply="none"))
    cut = post(url, "/classify", {"input": [LONG]})  # cut, as Infinity's pipeline (truncation=True) does
    assert cut.headers["x-shoal-truncated"] == "0"
    same(scored(cut.json()["data"][0]), pipe(LONG, top_k=None, truncation=True, max_length=MAX_LENGTH))


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input": "a"}, "$.input"),
        ({"input": []}, "$.input"),
        ({"input": ["a"], "top_k": 1}, "top_k"),
        ({"model": MODEL_ID, "input": ["a"]}, "is not a text classifier"),
    ],
)
def test_a_bad_classify_body_is_a_400_naming_the_field(url, body, words):
    response = post(url, "/classify", body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


# --- Hugging Face Inference API: InferenceClient.text_classification ------------------------------


@pytest.fixture
def offline_lifted(monkeypatch):
    """HF_HUB_OFFLINE is lifted for these loopback servers only."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)


def test_huggingface_hub_text_classification_equals_the_pipeline(url, pipe, offline_lifted):
    from huggingface_hub import InferenceClient

    hf = InferenceClient(model=url, timeout=120)
    every = hf.text_classification(TEXTS[0])  # sends "parameters": {}; the one preloaded classifier answers
    same([(e.label, e.score) for e in every], pipe(TEXTS[0], top_k=None))
    best = hf.text_classification(TEXTS[1], top_k=1)
    same([(e.label, e.score) for e in best], pipe(TEXTS[1], top_k=1))
    sigmoid = hf.text_classification(TEXTS[2], function_to_apply="sigmoid")
    same([(e.label, e.score) for e in sigmoid], pipe(TEXTS[2], top_k=None, function_to_apply="sigmoid"))
    logits = InferenceClient(base_url=url, timeout=120).text_classification(TEXTS[3], function_to_apply="none")
    same([(e.label, e.score) for e in logits], pipe(TEXTS[3], top_k=None, function_to_apply="none"))


def test_a_body_naming_no_task_goes_by_the_models_kind_and_two_kinds_ask_for_a_model(extract_only_url, pipe):
    body = {"inputs": TEXTS[0], "parameters": {}}
    ambiguous = post(extract_only_url, "/", body)
    assert ambiguous.status_code == 400
    assert ambiguous.json()["error"]["details"]["candidates"] == [CLASSIFIER, TAGGER]
    classified = post(extract_only_url, "/", body, headers={"x-shoal-model": CLASSIFIER})
    same(scored(classified.json()[0]), pipe(TEXTS[0], top_k=None))
    tagged = post(extract_only_url, f"/?model={TAGGER}", body)
    assert tagged.status_code == 200 and all("entity_group" in e for e in tagged.json())
    by_field = post(extract_only_url, "/", {"inputs": TEXTS[0], "parameters": {"top_k": 2}})
    same(scored(by_field.json()[0]), pipe(TEXTS[0], top_k=2))


@pytest.mark.parametrize(
    "parameters, words",
    [
        ({"top_k": 0}, "$.parameters.top_k"),
        ({"function_to_apply": "max"}, "$.parameters.function_to_apply"),
        ({"top_k": 1, "aggregation_strategy": "simple"}, "aggregation_strategy"),
    ],
)
def test_a_bad_text_classification_body_is_a_400_naming_the_field(url, parameters, words):
    response = post(url, "/", {"inputs": "a", "parameters": parameters})
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_native_extract_takes_function_to_apply(url, pipe):
    body = {"model": CLASSIFIER, "items": [{"text": TEXTS[0]}], "options": {"function_to_apply": "sigmoid"}}
    answer = post(url, "/v1/extract", body).json()
    same(scored(answer["items"][0]["labels"]), pipe(TEXTS[0], top_k=None, function_to_apply="sigmoid"))
    both = {**body, "options": {"function_to_apply": "softmax", "raw_scores": True}}
    refused = post(url, "/v1/extract", both)
    assert refused.status_code == 400 and "send one of them" in refused.json()["error"]["message"]


# --- the OpenAPI document -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/predict", {"inputs": TEXTS[0]}),
        ("/predict", {"inputs": [TEXTS[0], PAIRS[0]], "raw_scores": True}),
        ("/predict", {"inputs": [[TEXTS[0]], [TEXTS[1], PAIRS[1]]], "truncate": True}),
        ("/classify", {"input": TEXTS, "raw_scores": False}),
        ("/", {"inputs": TEXTS[0], "parameters": {"top_k": 2, "function_to_apply": "softmax"}}),
    ],
)
def test_the_document_describes_the_bodies_sent_and_answered(url, path, body):
    document = httpx.get(f"{url}/openapi.json").json()
    operation = document["paths"][path]["post"]

    def schema(media: dict) -> dict:
        return {**media["content"]["application/json"]["schema"], "components": document["components"]}

    jsonschema.validate(body, schema(operation["requestBody"]))
    response = post(url, path, body)
    assert response.status_code == 200, response.text
    jsonschema.validate(response.json(), schema(operation["responses"]["200"]))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**body, "unknown": 1}, schema(operation["requestBody"]))
