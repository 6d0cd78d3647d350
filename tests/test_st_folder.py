"""sentence-transformers folders: shoal's dense head reads and applies the folder's Pooling (mode and
`include_prompt`), Dense and Normalize modules, compared with `SentenceTransformer(dir).encode` on
small random BERT models built and saved here; a card that contradicts the folder does not load."""

from __future__ import annotations

import asyncio
import json

import msgspec
import numpy as np
import pytest
import torch
import yaml

from shoal.catalog import Catalog, resolve_weights
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.engine.runner import ModelRunner
from shoal.errors import ModelLoadError
from shoal.heads.st_folder import read_pipeline

PROMPT = "Represent this sentence for retrieval: "
TEXTS = [
    "The cat sat on the mat.",
    "a",
    "Quantum computing uses qubits, superposition and entanglement!",
    # longer than max_seq_length with the prompt: both sides truncate
    " ".join(f"word{i} of a long text" for i in range(40)),
    "naïve café, déjà vu — 東京",
]
MAX_LENGTH = 48


def minilm_dir():
    return resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)


def build_st_folder(path, *, pooling: str, include_prompt: bool, after: list[tuple], seed: int):
    """A random 2-layer BERT (MiniLM's vocabulary) with these modules, saved by sentence-transformers.
    `after`: the modules after Pooling, in order: ("dense", out_features, activation class name, bias)
    or ("normalize",)."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(seed)
    encoder_dir = path / "encoder"
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    transformers.BertModel(config).save_pretrained(encoder_dir)
    transformers.AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(encoder_dir)
    modules = [
        Transformer(str(encoder_dir), max_seq_length=MAX_LENGTH),
        Pooling(32, pooling_mode=pooling, include_prompt=include_prompt),
    ]
    width = 32
    for kind, *args in after:
        if kind == "normalize":
            modules.append(Normalize())
            continue
        out_features, activation, bias = args
        layer = Dense(width, out_features, bias=bias, activation_function=getattr(torch.nn, activation)())
        torch.nn.init.normal_(layer.linear.weight, std=0.5)  # far from the identity, so skipping it shows
        modules.append(layer)
        width = out_features
    model_dir = path / "model"
    SentenceTransformer(modules=modules, device="cpu").save(str(model_dir))
    return model_dir


def card_dict(model_dir, **fields) -> dict:
    card = {
        "id": "local/st-folder",
        "architecture": "bert",
        "source": {"path": str(model_dir)},
        "max_length": MAX_LENGTH,
        "outputs": ["dense"],
        "prompts": {"query": PROMPT},
        "query_prompt": "query",
    }
    return {**card, **fields}


def shoal_encode(tmp_path, card: dict, calls: list[dict]) -> list[np.ndarray]:
    (tmp_path / "card.yaml").write_text(yaml.safe_dump(card))
    catalog = Catalog.load(extra_dirs=(tmp_path,))

    async def main():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            return [np.stack((await engine.encode(EncodeCall(card["id"], TEXTS, **c))).vectors) for c in calls]
        finally:
            await engine.stop()

    return asyncio.run(main())


NORMALIZE = ("normalize",)
PIPELINES = {
    # name: (pooling, card pooling, include_prompt, modules after Pooling)
    "mean-no-prompt-tanh-dense-normalize": ("mean", "mean", False, [("dense", 24, "Tanh", True), NORMALIZE]),
    "cls-no-prompt-two-dense": ("cls", "cls", False, [("dense", 24, "Tanh", True), ("dense", 12, "Identity", False)]),
    "lasttoken-with-prompt-normalize": ("lasttoken", "last", True, [NORMALIZE]),
    # a Normalize that is not last changes what the next Dense sees (a final one only rescales)
    "mean-normalize-then-relu-dense": ("mean", "mean", True, [NORMALIZE, ("dense", 16, "ReLU", True)]),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_folder_modules_match_sentence_transformers_encode_with_and_without_prompt(tmp_path, name):
    from sentence_transformers import SentenceTransformer

    pooling, card_pooling, include_prompt, after = PIPELINES[name]
    model_dir = build_st_folder(tmp_path, pooling=pooling, include_prompt=include_prompt, after=after, seed=len(name))
    reference = SentenceTransformer(str(model_dir), device="cpu")
    plain = reference.encode(TEXTS, convert_to_numpy=True)
    prompted = reference.encode(TEXTS, prompt=PROMPT, convert_to_numpy=True)
    dense = [m for m in after if m[0] == "dense"]
    dimensions = dense[-1][1] if dense else 32
    normalize = after[-1] == NORMALIZE
    assert plain.shape == (len(TEXTS), dimensions)

    card = card_dict(model_dir, pooling=card_pooling, dimensions=dimensions, normalize=normalize)
    got_plain, got_prompted = shoal_encode(tmp_path, card, [{}, {"is_query": True}])
    np.testing.assert_allclose(got_plain, plain, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got_prompted, prompted, atol=2e-5, rtol=1e-4)


def test_include_prompt_false_changes_the_vector_so_the_masking_is_observable(tmp_path):
    """Guards the test above: with the prompt pooled in, the reference's vectors are far from its
    include_prompt=False ones, so a head that ignored `include_prompt` would fail it."""
    from sentence_transformers import SentenceTransformer

    model_dir = build_st_folder(tmp_path, pooling="mean", include_prompt=False, after=[NORMALIZE], seed=3)
    reference = SentenceTransformer(str(model_dir), device="cpu")
    excluded = reference.encode(TEXTS, prompt=PROMPT)
    reference[1].include_prompt = True
    included = reference.encode(TEXTS, prompt=PROMPT)
    assert np.abs(excluded - included).max() > 1e-2
    [got] = shoal_encode(tmp_path, card_dict(model_dir, pooling="mean", dimensions=32), [{"is_query": True}])
    np.testing.assert_allclose(got, excluded, atol=2e-5)


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    return build_st_folder(
        tmp_path_factory.mktemp("st"),
        pooling="mean",
        include_prompt=True,
        after=[("dense", 16, "Tanh", True), NORMALIZE],
        seed=7,
    )


@pytest.mark.parametrize("field, value", [("pooling", "cls"), ("dimensions", 32), ("normalize", False)])
def test_a_card_that_contradicts_the_folder_is_a_load_error_naming_the_field(dense_folder, field, value):
    from shoal.catalog import parse_card

    card = parse_card(card_dict(dense_folder, pooling="mean", dimensions=16, normalize=True), "test")
    ModelRunner.from_dir(card, dense_folder, "cpu")  # the agreeing card loads
    wrong = msgspec.structs.replace(card, **{field: value})
    with pytest.raises(ModelLoadError, match=f"`{field}`") as caught:
        ModelRunner.from_dir(wrong, dense_folder, "cpu")
    assert caught.value.details["field"] == field


def test_a_pooling_mode_the_card_cannot_express_is_a_load_error(dense_folder, tmp_path):
    import shutil

    from shoal.catalog import parse_card

    folder = tmp_path / "max"
    shutil.copytree(dense_folder, folder)
    config = folder / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode": "max"}))
    card = parse_card(card_dict(folder, pooling="mean", dimensions=16), "test")
    with pytest.raises(ModelLoadError, match="`pooling`.*max"):
        ModelRunner.from_dir(card, folder, "cpu")


def test_legacy_pooling_config_reads_as_sentence_transformers_loads_it():
    """all-MiniLM-L6-v2 ships the older `pooling_mode_mean_tokens` / `word_embedding_dimension` keys."""
    from sentence_transformers import SentenceTransformer

    directory = minilm_dir()
    reference = SentenceTransformer(str(directory), device="cpu")
    pipeline = read_pipeline(directory)
    assert pipeline.modes == (reference[1].pooling_mode,)
    assert pipeline.include_prompt == reference[1].include_prompt
    assert pipeline.dimensions == reference.get_embedding_dimension()
    assert pipeline.normalizes == (type(reference[-1]).__name__ == "Normalize")
