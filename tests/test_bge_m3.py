"""BGE-M3's three outputs from one pass (dense, lexical weights, ColBERT vectors) against FlagEmbedding's
own BGE-M3 inference class, run here on a random XLM-R with a SentencePiece-style (Unigram) tokenizer
and its heads saved as BGE-M3 ships them (`colbert_linear.pt`, `sparse_linear.pt`)."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from shoal.catalog import Catalog
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine

MAX_LENGTH = 64
HIDDEN = 64
CORPUS = [
    "The cat sat on the mat.",
    "Quantum computing uses qubits, superposition and entanglement!",
    "Shoals of small fish move together; predators find it hard to pick one out.",
    "Stock markets fell sharply on Tuesday after the central bank raised interest rates by half a point.",
    "Les poissons nagent ensemble dans la mer, loin des requins.",
    "Die Fische schwimmen zusammen im Meer.",
    "Late interaction keeps one vector per token, dense retrieval keeps one per text.",
]
TEXTS = [
    "the the cat sat on the mat",  # a repeated token: its largest weight is kept
    "Late interaction keeps one vector per token.",
    "a <mask> in the text",  # FlagEmbedding keeps <mask>'s lexical weight; it drops only cls/eos/pad/unk
    "snowmen ☃ and ☄ are not in the vocabulary",  # <unk> tokens, which FlagEmbedding drops
    " ".join(CORPUS),  # longer than MAX_LENGTH tokens: truncated
]


def import_flag_embedding():
    """FlagEmbedding 1.4.2's package `__init__` imports every model it has, among them a MiniCPM reranker
    that imports `transformers.modeling_attn_mask_utils`, a module transformers 5 removed. A stand-in
    module with those four names lets the import finish; nothing the BGE-M3 path runs touches them
    (they raise if called), so FlagEmbedding's BGE-M3 logic is unchanged."""
    name = "transformers.modeling_attn_mask_utils"
    if name not in sys.modules:
        try:
            __import__(name)
        except ImportError:

            def removed(*args, **kwargs):
                raise RuntimeError(f"{name} is not in transformers {transformers.__version__}")

            stub = types.ModuleType(name)
            stub.AttentionMaskConverter = type("AttentionMaskConverter", (), {"__init__": removed})
            for fn in (
                "_prepare_4d_attention_mask",
                "_prepare_4d_causal_attention_mask",
                "_prepare_4d_causal_attention_mask_for_sdpa",
            ):
                setattr(stub, fn, removed)
            sys.modules[name] = stub
    return pytest.importorskip("FlagEmbedding")


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    """A random XLMRobertaModel, an XLM-R tokenizer over a Unigram vocabulary trained here (<s> <pad> </s>
    <unk> first, <mask> last, as XLM-R's), and BGE-M3's two heads as torch state dicts."""
    directory = tmp_path_factory.mktemp("tiny-bge-m3")
    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.train_from_iterator(
        CORPUS * 20,
        trainers.UnigramTrainer(vocab_size=250, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>"),
    )
    vocab = [tuple(entry) for entry in json.loads(unigram.to_str())["model"]["vocab"]] + [("<mask>", 0.0)]
    tokenizer = transformers.XLMRobertaTokenizer(vocab=vocab)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.XLMRobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        type_vocab_size=1,
        max_position_embeddings=MAX_LENGTH + 2,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    transformers.XLMRobertaModel(config).eval().save_pretrained(directory)
    colbert_linear = torch.nn.Linear(HIDDEN, HIDDEN)  # FlagEmbedding's colbert_dim -1: hidden -> hidden
    sparse_linear = torch.nn.Linear(HIDDEN, 1)
    with torch.no_grad():  # mostly positive token weights, so which ids are dropped is what decides
        sparse_linear.weight.normal_(0.0, 0.05)
        sparse_linear.bias.fill_(0.5)
    torch.save(colbert_linear.state_dict(), directory / "colbert_linear.pt")
    torch.save(sparse_linear.state_dict(), directory / "sparse_linear.pt")
    return directory


@pytest.fixture(scope="module")
def reference(m3_dir):
    flag = import_flag_embedding()
    model = flag.BGEM3FlagModel(str(m3_dir), use_fp16=False, devices="cpu")
    out = model.encode(TEXTS, max_length=MAX_LENGTH, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(m3_dir)
    return out, tokenizer


@pytest.fixture(scope="module")
def shoal_items(tmp_path_factory, m3_dir):
    """The shipped BGE-M3 card, pointed at the random checkpoint and cut to its positions."""
    card = yaml.safe_load(Path(Catalog.load().get("BAAI/bge-m3").card_path).read_text())
    card.update(id="test/bge-m3", source={"path": str(m3_dir)}, max_length=MAX_LENGTH, dimensions=HIDDEN)
    card["multivector"]["dim"] = HIDDEN
    cards = tmp_path_factory.mktemp("cards")
    (cards / "card.yaml").write_text(yaml.safe_dump(card))
    engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(cards,)), allow_download=False)

    async def go():
        await engine.start()
        try:
            return await engine.encode(EncodeCall("test/bge-m3", TEXTS, outputs=("dense", "sparse", "multivector")))
        finally:
            await engine.stop()

    return asyncio.run(go()).items


def test_bge_m3_dense_vectors_equal_flag_embedding(reference, shoal_items):
    out, _ = reference
    for item, expected in zip(shoal_items, out["dense_vecs"]):
        assert np.abs(item.dense - expected).max() <= 1e-5


def test_bge_m3_lexical_weights_equal_flag_embedding_dropping_what_it_drops(reference, shoal_items):
    out, tokenizer = reference
    for item, expected in zip(shoal_items, out["lexical_weights"]):
        got = dict(zip(item.sparse.indices.tolist(), item.sparse.values.tolist()))
        want = {int(k): float(v) for k, v in expected.items()}
        assert got.keys() == want.keys()
        assert max(abs(got[k] - v) for k, v in want.items()) <= 1e-5
    # The texts exercise both rules: <mask> is kept, <unk> (and <s>, </s>) are not.
    assert tokenizer.mask_token_id in {int(k) for k in out["lexical_weights"][2]}
    assert tokenizer.unk_token_id in tokenizer(TEXTS[3])["input_ids"]
    assert tokenizer.unk_token_id not in {int(k) for k in out["lexical_weights"][3]}
    assert not {tokenizer.cls_token_id, tokenizer.eos_token_id} & {int(k) for w in out["lexical_weights"] for k in w}


def test_bge_m3_colbert_vectors_equal_flag_embedding_without_the_first_token(reference, shoal_items):
    out, tokenizer = reference
    for text, item, expected in zip(TEXTS, shoal_items, out["colbert_vecs"]):
        num_tokens = len(tokenizer(text, truncation=True, max_length=MAX_LENGTH)["input_ids"])
        assert item.multivector.shape == expected.shape == (num_tokens - 1, HIDDEN)
        assert np.abs(item.multivector - expected).max() <= 1e-5
    assert len(shoal_items[-1].multivector) == MAX_LENGTH - 1  # the long text was truncated
