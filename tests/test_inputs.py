"""Modality-neutral inputs: a call's items are texts or images (`calls.Item`), each through its
modality's preprocessor (`backend.Preprocessor`), refused by item where the card does not read it.

The engine path is exercised on the real MiniLM weights with a test image preprocessor put on the
loaded model's description: what is checked is the seam (order, cost, feature slots reaching the
backend's forward), not image quality, which the image cards' own tests cover.
"""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import numpy as np
import pytest

from conftest import WrappingBackend
from shoal import calls, verbs
from shoal.calls import EncodeCall, ExtractCall, Item, ScoreCall
from shoal.catalog import Catalog, parse_card
from shoal.engine.types import Encoded
from shoal.errors import CardError, InvalidRequest

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
CLS, SEP, PLACEHOLDER = 101, 102, 1000


@pytest.fixture(scope="module")
def minilm():
    return Catalog.load().get(MINILM)


def test_an_item_call_survives_the_wire_with_its_image_bytes_and_bare_strings_are_texts():
    call = EncodeCall(model="m", items=["a text", Item(image=b"\x89PNG\r\n"), Item(text="another")])
    back = calls.decode_call(calls.encode(call))
    assert back == call
    assert [calls.modality_of(item) for item in back.items] == ["text", "image", "text"]
    assert [calls.text_of(item) for item in back.items] == ["a text", None, "another"]
    # JSON carries the bytes as base64, as the native wire will
    assert msgspec.json.decode(msgspec.json.encode(call), type=calls.AnyCall) == call


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (EncodeCall(MINILM, ["fine", Item(image=b"GIF89a")]), r"items\[1\] is an image, and model .* reads text only"),
        (ScoreCall(MINILM, "q", ["d", "e", Item(image=b"x")]), r"documents\[2\] is an image, and model .* reads text"),
        (ScoreCall(MINILM, Item(image=b"x"), ["d"]), r"query is an image, and model .* reads text only"),
        (EncodeCall(MINILM, [Item()]), r"items\[0\] has neither a text nor an image: send one of them per item"),
        (EncodeCall(MINILM, [Item(text="a", image=b"b")]), r"items\[0\] has both a text and an image"),
        (EncodeCall(MINILM, ["a", 3]), r"items\[1\] is int, not a string"),  # type: ignore[list-item]
    ],
)
def test_an_input_the_card_does_not_read_is_refused_naming_it(minilm, call, message):
    from shoal.engine.tasks import task_for

    with pytest.raises(InvalidRequest, match=message):
        task_for(call, minilm).plan(minilm, call)


def test_an_image_costs_its_cards_image_tokens_in_the_one_estimate(minilm):
    card = msgspec.structs.replace(minilm, modalities=("text", "image"), image_tokens=50)
    text_only = verbs.estimate_tokens(EncodeCall(card.id, ["a photo of a cat"]), card)
    mixed = verbs.estimate_tokens(EncodeCall(card.id, ["a photo of a cat", Item(image=b"..."), Item(image=b"")]), card)
    assert mixed == text_only + 2 * 50
    # without a card (an unknown model), an image counts as IMAGE_TOKENS
    assert verbs.estimate_tokens(EncodeCall("nobody", [Item(image=b"...")]), None) == verbs.IMAGE_TOKENS + 2


def test_a_card_that_reads_images_says_what_one_costs():
    base = {"id": "x", "source": {"path": "."}, "max_length": 8, "pooling": "cls", "dimensions": 8}
    with pytest.raises(CardError, match="image_tokens"):
        parse_card({**base, "modalities": ["text", "image"]}, "<card>")
    with pytest.raises(CardError, match="modalities"):
        parse_card({**base, "modalities": []}, "<card>")
    assert parse_card({**base, "modalities": ["image"], "image_tokens": 197}, "<card>").image_tokens == 197


class Patches:
    """A test image preprocessor: an "image" is bytes, a row per byte in the feature slot `pixels`,
    its sequence [CLS] + a placeholder per row + [SEP]; bytes starting with b"bad" are refused."""

    modality = "image"

    def prepare(self, values, truncate, *, first_index, what):
        out = []
        for offset, data in enumerate(values):
            if data.startswith(b"bad"):
                raise InvalidRequest(f"{what}[{first_index + offset}] is not an image", details={})
            rows = np.frombuffer(data, dtype=np.uint8).astype(np.float32).reshape(-1, 1)
            ids = np.array([CLS] + [PLACEHOLDER] * len(rows) + [SEP], dtype=np.int64)
            out.append(Encoded(ids=ids, features={"pixels": rows}))
        return out


def test_a_mixed_call_runs_each_item_through_its_preprocessor_and_keeps_the_order(minilm):
    from shoal.config import EngineSettings
    from shoal.engine import Engine
    from shoal.engine.runner import TorchBackend

    batches = []

    class WithImages:
        def __init__(self, loaded) -> None:
            self._loaded = loaded
            self.info = dataclasses.replace(loaded.info, image=Patches())

        def __getattr__(self, name):
            return getattr(self._loaded, name)

        def forward(self, batch, specs):
            batches.append(batch)
            return self._loaded.forward(batch, specs)

    class TextLoad(WrappingBackend):  # the weights load as the text model they are
        def load(self, card):
            return super().load(msgspec.structs.replace(card, modalities=("text",), image_tokens=None))

    card = msgspec.structs.replace(minilm, modalities=("text", "image"), image_tokens=6)
    engine = Engine(
        EngineSettings(),
        Catalog([card]),
        backend=TextLoad(TorchBackend("cpu", allow_download=False), WithImages),
    )
    texts = ["a cat on a mat", "a dog in the fog"]

    async def main():
        await engine.start()
        try:
            alone = await engine.run(EncodeCall(card.id, texts))
            batches.clear()
            mixed = await engine.run(EncodeCall(card.id, [texts[0], Item(image=b"\x01\x02\x03"), Item(text=texts[1])]))
            with pytest.raises(InvalidRequest, match=r"items\[2\] is not an image"):
                await engine.run(EncodeCall(card.id, ["ok", Item(image=b"\x01"), Item(image=b"bad bytes")]))
            return alone, mixed
        finally:
            await engine.stop()

    alone, mixed = asyncio.run(main())
    vectors = mixed.vectors
    np.testing.assert_allclose(vectors[0], alone.vectors[0], atol=1e-5)
    np.testing.assert_allclose(vectors[2], alone.vectors[1], atol=1e-5)
    assert not np.allclose(vectors[1], vectors[0], atol=1e-3)
    # the image's sequence is its placeholder tokens, counted like tokens, its rows in a feature
    # slot of the batch it ran in (the engine may cut the call into batches for its lanes)
    image_tokens = 3 + 2
    assert mixed.num_tokens == alone.num_tokens + image_tokens
    assert sum(b.num_tokens for b in batches) == mixed.num_tokens and sum(b.num_seqs for b in batches) == 3
    (batch,) = [b for b in batches if b.features]
    slot = batch.features["pixels"]
    assert slot.values.ravel().tolist() == [1.0, 2.0, 3.0]
    rows = np.diff(slot.cu_rows)
    (image,) = np.flatnonzero(rows)
    assert rows[image] == 3 and batch.cu_seqlens[image + 1] - batch.cu_seqlens[image] == image_tokens


def test_extract_reads_texts_only_and_says_so_by_item():
    card = Catalog.load().get("urchade/gliner_small-v2.1")
    card = msgspec.structs.replace(card, modalities=("text", "image"), image_tokens=10)
    from shoal.engine.tasks import task_for

    call = ExtractCall(card.id, ["Ada Lovelace wrote", Item(image=b"...")], labels=["person"])
    with pytest.raises(InvalidRequest, match=r"items\[1\] is an image; model .* extracts from texts only"):
        task_for(call, card).plan(card, call)
