"""GLiClass zero-shot classifiers: shoal's prompt, label and text pooling, projectors and scorers
against the `gliclass` package's ZeroShotClassificationPipeline on the same random-initialised
checkpoint (saved with save_pretrained): same labels, scores <= 1e-4, multi- and single-label,
several texts and label sets, the scorers and poolings shoal serves; configurations it does not
serve are refused at load, naming the field."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gliclass")

from engine_calls import catalog_with, run
from extract_models import (
    SMALL,
    copy_tree,
    deberta_v3_config,
    extract_card,
    spread,
    unigram_tokenizer,
    wordpiece_tokenizer,
)
from shoal.api.errors import status_of
from shoal.engine import ExtractCall
from shoal.errors import InvalidRequest, ModelLoadError

TEXTS = [
    "The striker scored twice as the home team won the league title on Sunday.",
    "Parliament passed the budget after a long debate over taxes and public spending.",
    "Zürich-based Nestlé S.A. opened a café in São Paulo — its 12th in Brazil 🍫.",
    "x",
]
LABEL_SETS = [
    ["sports", "politics", "economy"],
    ["food", "travel", "business news", "science and technology", "weather"],
    ["positive"],
]


def build_gliclass(
    directory, seed: int = 0, special: bool = True, backbone: str = "deberta-v3", shape: dict | None = None, **config
):
    """A random GLiClass uni-encoder on a tiny DeBERTa-v3-like backbone, saved as gliclass saves it
    (save_pretrained, and the tokenizer with its added tokens beside it), or on a tiny ModernBERT
    with MiniLM's WordPiece (`backbone="modernbert"`); returns the reference
    pipeline's model and tokenizer, loaded back from the folder."""
    import transformers
    from gliclass import GLiClassModel, GLiClassModelConfig

    base = directory.parent / f"{directory.name}-backbone"
    if backbone == "modernbert":
        tokenizer = wordpiece_tokenizer(base)
        encoder = transformers.ModernBertConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            pad_token_id=0,
            cls_token_id=101,
            sep_token_id=102,
            bos_token_id=101,
            eos_token_id=102,
            global_attn_every_n_layers=2,
            local_attention=16,
            **SMALL,
        )
    else:
        tokenizer = unigram_tokenizer(base)
        encoder = deberta_v3_config(len(tokenizer), **(shape or {}))  # shape: the backbone's sizes (bench)
    size = len(tokenizer)
    encoder.save_pretrained(base)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<<LABEL>>", "<<SEP>>"]})
    else:
        tokenizer.add_tokens(["<<LABEL>>", "<<SEP>>"])
    settings = dict(
        encoder_config=encoder.to_dict(),
        encoder_model=str(base),
        class_token_index=size,
        text_token_index=size + 1,
        vocab_size=size + 2,
        hidden_size=encoder.hidden_size,
        dropout=0.0,
    )
    torch.manual_seed(seed)
    model = GLiClassModel(GLiClassModelConfig(**{**settings, **config}))
    for index, part in enumerate(model.model.children()):
        spread(part, seed + index)
    with torch.no_grad():
        model.model.logit_scale.fill_(3.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    reference = GLiClassModel.from_pretrained(str(directory)).eval()
    return reference, transformers.AutoTokenizer.from_pretrained(str(directory))


def pipeline(reference, classification_type: str):
    from gliclass import ZeroShotClassificationPipeline

    model, tokenizer = reference
    return ZeroShotClassificationPipeline(
        model, tokenizer, classification_type=classification_type, device="cpu", progress_bar=False, max_length=512
    )


def card(directory, max_length: int = 512) -> str:
    return extract_card(directory, "test/gliclass", "gliclass", max_length=max_length)


def assert_same(expected: list[dict], got, where: str) -> None:
    """The same labels and scores (a label each), shoal's best first."""
    want = {e["label"]: e["score"] for e in expected}
    have = {g.label: g.score for g in got}
    assert sorted(want) == sorted(have) and len(have) == len(got), where
    for label, score in want.items():
        assert abs(have[label] - score) <= 1e-4, (where, label, score, have[label])
    assert [g.score for g in got] == sorted(have.values(), reverse=True), where


@pytest.fixture(scope="module")
def weighted_dot(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gliclass") / "weighted-dot"
    return directory, build_gliclass(directory, seed=1, scorer_type="weighted-dot")


@pytest.mark.parametrize("threshold", [None, 0.0, 0.9])
def test_multi_label_scores_equal_gliclass_pipeline(tmp_path, weighted_dot, threshold):
    directory, reference = weighted_dot
    pipe = pipeline(reference, "multi-label")
    calls = [
        ExtractCall(model="test/gliclass", items=TEXTS, labels=labels, threshold=threshold) for labels in LABEL_SETS
    ]
    results = run(catalog_with(tmp_path, card(directory)), *calls)
    compared = 0
    for labels, result in zip(LABEL_SETS, results):
        expected = pipe(TEXTS, labels, threshold=0.5 if threshold is None else threshold)
        for i, (item, want) in enumerate(zip(result.items, expected)):
            assert_same(want, item.labels, f"labels {labels} text {i}")
            assert not item.truncated
            compared += len(want)
    assert compared >= (len(TEXTS) if threshold != 0.0 else len(TEXTS) * 9)  # not empty lists


def test_single_label_softmax_equals_gliclass_pipeline(tmp_path, weighted_dot):
    """The pipeline's single-label answer is the best label by softmax: shoal's first, with all the
    labels' softmax scores summing to one."""
    directory, reference = weighted_dot
    pipe = pipeline(reference, "single-label")
    calls = [ExtractCall(model="test/gliclass", items=TEXTS, labels=labels, multi_label=False) for labels in LABEL_SETS]
    results = run(catalog_with(tmp_path, card(directory)), *calls)
    for labels, result in zip(LABEL_SETS, results):
        for i, (item, (best,)) in enumerate(zip(result.items, pipe(TEXTS, labels))):
            assert len(item.labels) == len(labels)
            assert item.labels[0].label == best["label"], (labels, i)
            assert abs(item.labels[0].score - best["score"]) <= 1e-4, (labels, i)
            assert abs(sum(s.score for s in item.labels) - 1.0) <= 1e-6


@pytest.mark.parametrize(
    "options",
    [
        dict(scorer_type="simple", embed_class_token=False, normalize_features=True, special=False),
        dict(scorer_type="mlp", pooling_strategy="avg", class_token_pooling="average", prompt_first=True),
        dict(
            scorer_type="simple",
            pooling_strategy="max",
            class_token_pooling="average",
            embed_class_token=False,
            normalize_features=True,
        ),
        dict(backbone="modernbert", scorer_type="weighted-dot"),
    ],
    ids=["simple-next-token-normalized", "mlp-avg-prompt-first", "simple-max-average-labels", "modernbert"],
)
def test_scorers_and_poolings_equal_gliclass_pipeline(tmp_path, options):
    """Mean and max text pooling read the padded batch in the reference: it runs one text a batch."""
    directory = tmp_path / "model"
    reference = build_gliclass(directory, seed=3, **options)
    pipe = pipeline(reference, "multi-label")
    labels = LABEL_SETS[1]
    (result,) = run(
        catalog_with(tmp_path, card(directory)),
        ExtractCall(model="test/gliclass", items=TEXTS, labels=labels, threshold=0.0),
    )
    expected = pipe(TEXTS, labels, threshold=0.0, batch_size=1)
    for i, (item, want) in enumerate(zip(result.items, expected)):
        assert_same(want, item.labels, f"text {i}")
    spread_scores = {round(s.score, 3) for item in result.items for s in item.labels}
    assert len(spread_scores) > 5  # scores that could be wrong, not all 0 or 1


def test_long_texts_are_cut_and_said_truncated(tmp_path, weighted_dot):
    """Text first: the text is cut so that every label stays. Prompt first: the end is cut, as the
    pipeline's truncation cuts it (and the scores stay the reference's)."""
    directory, _ = weighted_dot
    long_text = " ".join(TEXTS * 60)
    labels = LABEL_SETS[1]
    (result,) = run(
        catalog_with(tmp_path, card(directory, max_length=128)),
        ExtractCall(model="test/gliclass", items=[long_text, TEXTS[0]], labels=labels, threshold=0.0),
    )
    assert [item.truncated for item in result.items] == [True, False]
    assert sorted(s.label for s in result.items[0].labels) == sorted(labels)

    first = tmp_path / "first"
    reference = build_gliclass(first, seed=4, prompt_first=True)
    pipe = pipeline(reference, "multi-label")
    pipe.pipe.max_length = 128
    (result,) = run(
        catalog_with(tmp_path, card(first, max_length=128)),
        ExtractCall(model="test/gliclass", items=[long_text, TEXTS[1]], labels=labels, threshold=0.0),
    )
    assert [item.truncated for item in result.items] == [True, False]
    for i, (item, want) in enumerate(zip(result.items, pipe([long_text, TEXTS[1]], labels, threshold=0.0))):
        assert_same(want, item.labels, f"text {i}")


def test_no_labels_is_a_400(tmp_path, weighted_dot):
    directory, _ = weighted_dot
    catalog = catalog_with(tmp_path, card(directory))
    calls = [
        ExtractCall(model="test/gliclass", items=TEXTS, labels=[]),
        ExtractCall(model="test/gliclass", items=TEXTS, labels=["<<LABEL>>sports"]),
        ExtractCall(model="test/gliclass", items=["a <<LABEL>> b"], labels=["sports"]),
        ExtractCall(model="test/gliclass", items=TEXTS, labels=["sports"], flat_ner=True),
    ]
    errors = run(catalog, *calls, catch=(InvalidRequest,))
    assert all(isinstance(e, InvalidRequest) for e in errors), errors
    assert [e.details.get("option") for e in errors] == ["labels", "labels", "items", "flat_ner"]
    assert status_of(errors[0]) == 400


@pytest.mark.parametrize(
    "field,value",
    [
        ("architecture_type", "bi-encoder"),
        ("scorer_type", "cross-attn"),
        ("pooling_strategy", "last"),
        ("use_lstm", True),
        ("use_segment_embeddings", True),
        ("encoder_layer_id", 3),
    ],
)
def test_unsupported_configurations_are_refused_naming_the_field(tmp_path, weighted_dot, field, value):
    directory, _ = weighted_dot
    copy = tmp_path / "model"
    copy_tree(directory, copy)
    path = copy / "config.json"
    config = json.loads(path.read_text())
    config[field] = value
    path.write_text(json.dumps(config))
    (error,) = run(
        catalog_with(tmp_path, card(copy)),
        ExtractCall(model="test/gliclass", items=TEXTS, labels=["sports"]),
        catch=(ModelLoadError,),
    )
    assert isinstance(error, ModelLoadError), error
    assert f"GLiClass {field}={json.dumps(value)}" in str(error).replace("'", '"').replace("True", "true")


def test_an_adapter_on_a_gliclass_model_is_a_400_saying_lora_is_not_supported(tmp_path, weighted_dot):
    directory, _ = weighted_dot
    (refused,) = run(
        catalog_with(tmp_path, card(directory)),
        ExtractCall(model="test/gliclass", items=TEXTS[:1], labels=["sports"], adapter="mine"),
        catch=(InvalidRequest,),
    )
    assert isinstance(refused, InvalidRequest) and "GLiClass model: LoRA adapters are not supported" in str(refused)
