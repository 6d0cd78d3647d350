"""CLIP and SigLIP served by the engine, against transformers on the same random-weight folders:
images sent as PNG and JPEG bytes of real photos (scikit-image's), through shoal's decode and
preprocessing, give transformers' image processor + `get_image_features`, normalised; texts give
`get_text_features` on the tokenizer's ids and mask (SigLIP's padded to its length as
SiglipProcessor pads them); a mixed call keeps its order; score ranks images for a text (and texts for an image)
by the model's own logits (CLIP's scaled cosine, SigLIP's sigmoid)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from skimage import data as photos

import engine_calls
from shoal.calls import EncodeCall, ExtractCall, Item, ScoreCall
from shoal.catalog import Catalog, parse_card
from shoal.config import EngineSettings
from shoal.errors import InvalidRequest, ModelLoadError, PayloadTooLarge
from vision_models import TEMPLATE, TEXT_SHAPE, tiny_clip

WORDS = [
    "this",
    "is",
    ".",
    "a",
    "photo",
    "of",
    "cat",
    "dog",
    "coffee",
    "cup",
    "woman",
    "astronaut",
    "red",
    "on",
    "the",
    "table",
]
TEXTS = ["a photo of a cat", "a red coffee cup on the table", "the astronaut", "dog"]
ATOL = 1e-4
# Text positions: CLIP's as the shared shape has them; SigLIP's 64, the length its processor (and
# transformers' zero-shot-image-classification pipeline) pads every text to.
MAX_TEXT = {"clip": TEXT_SHAPE["max_position_embeddings"], "siglip": 64}
LABELS = ["cat", "coffee cup", "astronaut", "dog"]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def served(request, tmp_path_factory):
    """(kind, transformers model, image processor, tokenizer, card) for a random checkpoint."""
    kind = request.param
    tiny = tiny_clip(
        tmp_path_factory.mktemp(kind),
        kind,
        model_id=f"test/{kind}",
        words=WORDS,
        extract=True,
        max_text=MAX_TEXT[kind],
    )
    return kind, tiny.reference, tiny.processor, tiny.tokenizer, parse_card(tiny.card, "<test>")


def run(card, *calls, settings: EngineSettings | None = None):
    return engine_calls.run(Catalog([card]), *calls, settings=settings)


def photo_bytes() -> list[bytes]:
    """The photos as a client sends them: PNG and JPEG files."""
    out = []
    for image, fmt in ((photos.astronaut(), "PNG"), (photos.coffee(), "JPEG"), (photos.chelsea(), "PNG")):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format=fmt)
        out.append(buffer.getvalue())
    return out


def reference_images(reference, processor, files: list[bytes]) -> np.ndarray:
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    pixel_values = torch.from_numpy(np.asarray(processor(images, return_tensors="np")["pixel_values"]))
    with torch.no_grad():
        out = reference.get_image_features(pixel_values=pixel_values).pooler_output
    return torch.nn.functional.normalize(out, dim=-1).numpy()


def tokenized(kind, tokenizer, text: str) -> dict:
    """A text as its processor gives it, ids and attention mask: SigLIP's padded to max_length."""
    if kind == "siglip":
        return tokenizer(text, padding="max_length", max_length=MAX_TEXT["siglip"], return_tensors="pt")
    return tokenizer(text, return_tensors="pt")


def reference_texts(kind, reference, tokenizer, texts: list[str]) -> np.ndarray:
    with torch.no_grad():
        rows = [reference.get_text_features(**tokenized(kind, tokenizer, text)).pooler_output for text in texts]
    return torch.nn.functional.normalize(torch.cat(rows), dim=-1).numpy()


def test_images_and_texts_encode_as_transformers_embeds_them_and_a_mixed_call_keeps_its_order(served):
    kind, reference, processor, tokenizer, card = served
    files = photo_bytes()
    images, texts, mixed = run(
        card,
        EncodeCall(card.id, [Item(image=f) for f in files]),
        EncodeCall(card.id, TEXTS),
        EncodeCall(card.id, [TEXTS[0], Item(image=files[1]), Item(text=TEXTS[1]), Item(image=files[0])]),
    )
    want_images = reference_images(reference, processor, files)
    want_texts = reference_texts(kind, reference, tokenizer, TEXTS)
    np.testing.assert_allclose(np.stack(images.vectors), want_images, atol=ATOL)
    np.testing.assert_allclose(np.stack(texts.vectors), want_texts, atol=ATOL)
    want_mixed = [want_texts[0], want_images[1], want_texts[1], want_images[0]]
    np.testing.assert_allclose(np.stack(mixed.vectors), np.stack(want_mixed), atol=ATOL)
    assert images.num_tokens == 3 * card.image_tokens  # an image costs its patches (+ a class token)


def test_score_ranks_images_for_a_text_and_texts_for_an_image_by_the_models_own_logits(served):
    kind, reference, processor, tokenizer, card = served
    files = photo_bytes()
    by_text, by_image, raw = run(
        card,
        ScoreCall(card.id, TEXTS[0], [Item(image=f) for f in files]),
        ScoreCall(card.id, Item(image=files[2]), TEXTS),
        ScoreCall(card.id, TEXTS[0], [Item(image=f) for f in files], raw_scores=True),
    )
    with torch.no_grad():
        pixel_values = torch.from_numpy(
            np.asarray(
                processor([Image.open(io.BytesIO(f)).convert("RGB") for f in files], return_tensors="np")[
                    "pixel_values"
                ]
            )
        )
        for_text = [
            reference(**tokenized(kind, tokenizer, text), pixel_values=pixel_values).logits_per_text[0]
            for text in TEXTS
        ]
        logits = torch.stack(for_text).numpy()  # [texts, images]
    activate = (lambda x: 1 / (1 + np.exp(-x))) if kind == "siglip" else (lambda x: x)

    got = {item.index: item.score for item in by_text.items}
    np.testing.assert_allclose([got[i] for i in range(3)], activate(logits[0]), rtol=1e-4, atol=1e-4)
    assert [item.index for item in by_text.items] == list(np.argsort(-logits[0]))
    got = {item.index: item.score for item in by_image.items}
    np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], activate(logits[:, 2]), rtol=1e-4, atol=1e-4)
    got = {item.index: item.score for item in raw.items}
    np.testing.assert_allclose([got[i] for i in range(3)], logits[0], rtol=1e-4, atol=1e-4)


def test_a_bad_image_is_refused_naming_it_and_the_card_must_say_what_an_image_costs(served):
    kind, reference, processor, tokenizer, card = served
    files = photo_bytes()
    with pytest.raises(InvalidRequest, match=r"items\[1\]"):
        run(card, EncodeCall(card.id, [Item(image=files[0]), Item(image=b"\x89PNG\r\n\x1a\nnot a png")]))
    import msgspec

    wrong = msgspec.structs.replace(card, image_tokens=card.image_tokens + 1)
    with pytest.raises(ModelLoadError, match="image_tokens"):
        run(wrong, EncodeCall(card.id, [Item(image=files[0])]))


def test_image_labels_equal_transformers_zero_shot_image_classification_pipeline(served):
    kind, reference, processor, tokenizer, card = served
    files = photo_bytes()
    classify = transformers.pipeline(
        "zero-shot-image-classification", model=reference, tokenizer=tokenizer, image_processor=processor
    )
    (labels, custom) = run(
        card,
        ExtractCall(card.id, [Item(image=f) for f in files], labels=LABELS),
        ExtractCall(card.id, [Item(image=files[0])], labels=LABELS[:2], hypothesis_template="a {}"),
    )
    for item, file in zip(labels.items, files):
        want = classify(
            Image.open(io.BytesIO(file)).convert("RGB"), candidate_labels=LABELS, hypothesis_template=TEMPLATE
        )
        assert [s.label for s in item.labels] == [w["label"] for w in want]
        np.testing.assert_allclose([s.score for s in item.labels], [w["score"] for w in want], atol=1e-5)
    want = classify(
        Image.open(io.BytesIO(files[0])).convert("RGB"), candidate_labels=LABELS[:2], hypothesis_template="a {}"
    )
    np.testing.assert_allclose([s.score for s in custom.items[0].labels], [w["score"] for w in want], atol=1e-5)
    with pytest.raises(InvalidRequest, match=r"items\[0\] is a text; model .* labels images only"):
        run(card, ExtractCall(card.id, ["a text"], labels=LABELS))


def test_the_engines_image_limits_refuse_a_file_before_decoding_it(served):
    kind, reference, processor, tokenizer, card = served
    files = photo_bytes()  # the astronaut is 512 x 512
    small = EngineSettings(max_image_pixels=512 * 512 - 1)
    with pytest.raises(PayloadTooLarge, match=r"items\[1\]"):
        run(card, EncodeCall(card.id, [Item(image=files[2]), Item(image=files[0])]), settings=small)
    with pytest.raises(PayloadTooLarge, match=r"items\[0\]"):
        run(card, EncodeCall(card.id, [Item(image=files[0])]), settings=EngineSettings(max_image_bytes=1000))
