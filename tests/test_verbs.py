"""The verb registry (shoal/verbs.py): one task per verb and extract kind, one token estimate that
the engine's admission, the gateway's pull-sizing header and the worker share; and the seam's
promise that planning is torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shoal import verbs
from shoal.bench.workloads import glirel_schema
from shoal.calls import EncodeCall, ExtractCall, GenerateCall, Item, Message, ScoreCall
from shoal.catalog import Catalog
from shoal.engine.tasks import task_for
from shoal.verbs import KINDS, estimate_tokens, kind_of

TEXTS = [
    "Ada Lovelace wrote the first program for Charles Babbage's engine in London.",
    "short",
    "A much longer text about the river Thames, " * 40,
]
LABELS = ["person", "place", "machine", "Person"]
IMAGES = [Item(image=b"\x89PNG..."), Item(image=b"\xff\xd8\xff...")]  # planning reads no pixel


def calls_for(card):
    """One call of each verb the card serves, with options that change what the task runs."""
    out = []
    if "encode" in card.tasks:
        out.append(EncodeCall(card.id, TEXTS, is_query=True))
        if "image" in card.modalities:
            out.append(EncodeCall(card.id, [*TEXTS, *IMAGES]))
    if "score" in card.tasks:
        out.append(ScoreCall(card.id, "who wrote the first program?", TEXTS))
        if "image" in card.modalities:
            out.append(ScoreCall(card.id, "a photo of a cat", IMAGES))
        if card.score is not None and card.score.kind == "cross_encoder":
            out.append(ScoreCall(card.id, "who wrote it?", TEXTS, window_overlap_tokens=16))
    if "generate" in card.tasks:
        out.append(GenerateCall(card.id, messages=[Message("user", TEXTS[0])], max_new_tokens=32))
    if "extract" in card.tasks and card.extract is not None and card.extract.kind == "generate":
        out.append(ExtractCall(card.id, TEXTS, schema={"type": "object"}, max_new_tokens=32))
    elif "extract" in card.tasks and card.extract is not None:
        labels = [] if card.extract.kind == "token_class" else LABELS
        items = IMAGES if card.extract.kind == "image_labels" else TEXTS
        schema = glirel_schema(tuple(TEXTS)) if card.extract.kind == "glirel" else None  # entities given
        out.append(ExtractCall(card.id, items, labels=labels, schema=schema))
    return out


CATALOG = Catalog.load()
CASES = [(card.id, call) for card in CATALOG for call in calls_for(card)]


@pytest.mark.parametrize(
    ("model_id", "call"), CASES, ids=[f"{m}-{type(c).__name__}-{i}" for i, (m, c) in enumerate(CASES)]
)
def test_the_engine_plan_and_the_gateways_header_count_a_call_alike(model_id, call):
    card = CATALOG.get(model_id)
    planned = task_for(call, card).plan(card, call).estimated_tokens
    assert planned == estimate_tokens(call, card)
    assert planned > 0


def test_an_image_costs_its_cards_image_tokens_wherever_it_is_sent():
    clip = CATALOG.get("openai/clip-vit-base-patch16")
    assert clip.image_tokens == 197
    assert estimate_tokens(EncodeCall(clip.id, IMAGES), clip) == 2 * 197
    assert estimate_tokens(ScoreCall(clip.id, IMAGES[0], IMAGES), clip) == 3 * 197
    labels = estimate_tokens(ExtractCall(clip.id, IMAGES, labels=["cat"]), clip)
    assert labels == 2 * 197 + estimate_tokens(ExtractCall(clip.id, [], labels=["cat"]), clip)


def test_a_zero_shot_call_costs_a_pair_per_label_and_a_gliner_call_a_prompt_per_window():
    nli = CATALOG.get("MoritzLaurer/deberta-v3-base-zeroshot-v2.0")
    one = estimate_tokens(ExtractCall(nli.id, TEXTS, labels=["a"]), nli)
    assert estimate_tokens(ExtractCall(nli.id, TEXTS, labels=["a", "b", "c"]), nli) == 3 * one
    gliner = next(card for card in CATALOG if card.extract is not None and card.extract.kind == "gliner")
    few = estimate_tokens(ExtractCall(gliner.id, TEXTS, labels=["person"]), gliner)
    many = estimate_tokens(ExtractCall(gliner.id, TEXTS, labels=[f"label number {i}" for i in range(20)]), gliner)
    assert many > few + 20 * len(TEXTS)  # the label prompt is read with every window of every text


def test_a_glirel_call_costs_each_text_once_with_the_relation_type_prompt():
    glirel = CATALOG.get("jackboyla/glirel-large-v0")
    schema = glirel_schema(tuple(TEXTS))
    one = estimate_tokens(ExtractCall(glirel.id, TEXTS, labels=["a"], schema=schema), glirel)
    three = estimate_tokens(ExtractCall(glirel.id, TEXTS, labels=["a", "b", "c"], schema=schema), glirel)
    # each more type is "[REL] type" in every text's one sequence: its tokens (2 with specials) + [REL]
    assert three - one == 2 * 3 * len(TEXTS)
    assert one == sum(len(t) // 4 + 2 for t in TEXTS) + len(TEXTS) * (3 + 1)  # the text, [REL] a, [SEP]


def test_each_extract_kind_has_its_own_task_and_a_card_that_does_not_serve_a_verb_is_refused():
    from shoal.errors import InvalidRequest

    kinds = {card.extract.kind for card in CATALOG if card.extract is not None}
    assert {f"extract:{kind}" for kind in kinds} <= set(KINDS)
    tasks = {
        type(task_for(ExtractCall(card.id, ["x"], labels=["y"]), card)).__name__
        for card in CATALOG
        if card.extract is not None
    }
    assert tasks == {
        "GlinerTask",
        "TokenClassTask",
        "ZeroShotTask",
        "ImageLabelsTask",
        "ClassifyTask",
        "GliclassTask",
        "Gliner2Task",
        "GlirelTask",
        "ExtractGenerateTask",
    }
    embedder = CATALOG.get("sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(InvalidRequest, match="does not extract"):
        kind_of(ExtractCall(embedder.id, ["x"], labels=["y"]), embedder)


def test_planning_imports_neither_torch_nor_heads():
    """Tasks plan from the backend's torch-free ModelInfo: importing every task (and the backend
    seam) loads no torch and no head module."""
    code = (
        "import sys\n"
        "from shoal.verbs import KINDS\n"
        "from shoal.engine.tasks import task_of_kind\n"
        "import shoal.engine.backend\n"
        "[task_of_kind(name) for name in KINDS]\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m == 'torch' or m.startswith('shoal.heads') or m.startswith('shoal.layers'))\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_batch_packs_feature_slots_per_sequence_and_refuses_mixed_rows():
    """Feature slots (an image's patch rows, later) pack like ids: every sequence's rows back to
    back, with each sequence's first row in `cu_rows`; a sequence without the slot has none."""
    import numpy as np

    from shoal.engine.types import Batch, Encoded

    ids = np.arange(3, dtype=np.int64)
    a = Encoded(ids, features={"pixels": np.ones((2, 4), np.float32)})
    b = Encoded(ids)
    c = Encoded(ids, features={"pixels": np.full((3, 4), 2, np.float32)})
    batch = Batch.pack([a, b, c])
    slot = batch.features["pixels"]
    assert slot.cu_rows.tolist() == [0, 2, 2, 5]
    assert slot.values.shape == (5, 4) and slot.values[2:].min() == 2.0
    assert Batch.pack([b, b]).features == {}
    with pytest.raises(ValueError, match="one dtype and row shape"):
        Batch.pack([a, Encoded(ids, features={"pixels": np.ones((1, 5), np.float32)})])


def test_every_verb_of_the_registry_has_routes_and_every_routes_verb_is_in_the_registry():
    from shoal.api.table import ROUTES

    served = {route.verb for route in ROUTES if route.verb is not None}
    assert served == set(verbs.VERB_OF_CALL.values())
    # a route that makes a call reads a body, and a probe makes none
    assert all(route.request is not None for route in ROUTES if route.verb is not None)


def test_a_generation_costs_its_prompt_and_the_new_tokens_it_asks_for():
    smol = CATALOG.get("HuggingFaceTB/SmolLM2-135M-Instruct")
    chat = [Message("system", "s" * 40), Message("user", "u" * 400)]
    asked = estimate_tokens(GenerateCall(smol.id, messages=chat, max_new_tokens=32), smol)
    assert asked == (10 + 8) + (100 + 8) + 32  # each message ~4 characters a token and its template's 8
    assert estimate_tokens(GenerateCall(smol.id, messages=chat), smol) == asked - 32 + smol.generate.max_new_tokens
    # Extraction: each text with the card's frame around it, and the new tokens of each record.
    one = estimate_tokens(ExtractCall(smol.id, ["a" * 400], schema={"type": "object"}, max_new_tokens=32), smol)
    two = estimate_tokens(ExtractCall(smol.id, ["a" * 400] * 2, schema={"type": "object"}, max_new_tokens=32), smol)
    assert two == 2 * one and one > 100 + 32
