"""Repos that ship `vocab.txt` without tokenizer.json, and `pytorch_model.bin` without safetensors,
load and serve what transformers computes on the same folder; the Hub allow-patterns fetch every
file the loader reads, and skip .bin weights where safetensors exist."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file

from shoal.catalog import Catalog, resolve_weights
from shoal.catalog.resolve import download_patterns
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.engine.tokenizer_files import wordpiece_from_vocab

TEXTS = [
    "The cat sat on the mat.",
    "a",
    "naïve café, déjà vu, Ångström, Straße",
    "東京は日本の首都です。数据和模型",
    "Mask me: [MASK] and [SEP] inside a text, [UNK] too",
    "   leading\tand trailing\nwhitespace   ",
    "UPPER CASE and MiXeD case text",
    "antidisestablishmentarianism " + "x" * 120,
    "$100 + €50 = ¥? ~ 10% off; #hashtag @mention 🙂",
    " ".join(f"word{i}" for i in range(300)),  # past max_length: both sides truncate
]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)


def vocab_folder(path: Path, minilm_dir: Path, tokenizer_config: dict | None = None) -> Path:
    """config.json + vocab.txt + tokenizer_config.json + special_tokens_map.json, no tokenizer.json."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, path / name)
    config = json.loads((minilm_dir / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, **(tokenizer_config or {})}))
    return path


def engine_encode(tmp_path: Path, card: dict, **call) -> list:
    (tmp_path / f"{card['id'].replace('/', '-')}.yaml").write_text(yaml.safe_dump(card))

    async def main():
        engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(tmp_path,)), allow_download=False)
        await engine.start()
        try:
            return (await engine.encode(EncodeCall(card["id"], TEXTS, **call))).items
        finally:
            await engine.stop()

    return asyncio.run(main())


# --- vocab.txt -----------------------------------------------------------------------------------


TOKENIZER_CASES = {
    "uncased": {},
    "cased": {"do_lower_case": False},
    "uncased-keep-accents": {"strip_accents": False},
    "no-chinese-split": {"tokenize_chinese_chars": False},
}


@pytest.mark.parametrize("case", TOKENIZER_CASES, ids=list(TOKENIZER_CASES))
def test_wordpiece_from_vocab_txt_gives_bert_tokenizer_ids(tmp_path, minilm_dir, case):
    folder = vocab_folder(tmp_path, minilm_dir, TOKENIZER_CASES[case])
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert type(reference).__name__ == "BertTokenizer" and not (folder / "tokenizer.json").exists()
    ours = wordpiece_from_vocab(folder)
    assert [e.ids for e in ours.encode_batch(TEXTS)] == reference(TEXTS)["input_ids"]
    pairs = list(zip(TEXTS[:5], TEXTS[5:]))
    expected = reference([a for a, _ in pairs], [b for _, b in pairs])
    got = ours.encode_batch(pairs)
    assert [e.ids for e in got] == expected["input_ids"]
    assert [e.type_ids for e in got] == expected["token_type_ids"]


def test_the_config_flags_change_the_ids_so_the_cases_above_can_fail(tmp_path, minilm_dir):
    uncased = wordpiece_from_vocab(vocab_folder(tmp_path / "a", minilm_dir))
    cased = wordpiece_from_vocab(vocab_folder(tmp_path / "b", minilm_dir, {"do_lower_case": False}))
    assert uncased.encode(TEXTS[6]).ids != cased.encode(TEXTS[6]).ids


# --- pytorch_model.bin + vocab.txt, served ---------------------------------------------------------


def test_bin_and_vocab_only_minilm_serves_what_transformers_computes(tmp_path, minilm_dir):
    folder = vocab_folder(tmp_path / "model", minilm_dir)
    torch.save(load_file(str(minilm_dir / "model.safetensors")), folder / "pytorch_model.bin")
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "pytorch_model.bin",
        "special_tokens_map.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state  # [n, L, 384]
    mask = batch["attention_mask"][..., None].float()
    expected = torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1).numpy()

    card = {
        "id": "local/minilm-bin",
        "architecture": "bert",
        "source": {"path": str(folder)},
        "max_length": 256,
        "pooling": "mean",
        "normalize": True,
        "dimensions": 384,
    }
    items = engine_encode(tmp_path, card)
    np.testing.assert_allclose(np.stack([i.dense for i in items]), expected, atol=1e-5)


def test_splade_v2_distil_card_serves_from_its_hub_layout(tmp_path, minilm_dir):
    """The card's own fields on a folder laid out as naver/splade_v2_distil's repo (config.json,
    pytorch_model.bin, vocab.txt, tokenizer_config.json, special_tokens_map.json): a random small
    DistilBertForMaskedLM over the uncased BERT vocabulary, against transformers' SPLADE weights."""
    folder = vocab_folder(tmp_path / "model", minilm_dir, {"tokenizer_class": "DistilBertTokenizer"})
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    reference = transformers.DistilBertForMaskedLM(config).eval()
    config.save_pretrained(folder)
    torch.save(reference.state_dict(), folder / "pytorch_model.bin")

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = (torch.log1p(torch.relu(logits)) * batch["attention_mask"][..., None]).max(dim=1).values.numpy()

    card = yaml.safe_load(Path(Catalog.load().get("naver/splade_v2_distil").card_path).read_text())
    card.update(id="local/splade-v2-distil-layout", source={"path": str(folder)})
    items = engine_encode(tmp_path, card, outputs=("sparse",))
    for item, ref in zip(items, expected):
        got = np.zeros_like(ref)
        got[item.sparse.indices] = item.sparse.values
        assert np.abs(got - ref).max() <= 1e-4
        assert set(np.flatnonzero(ref > 1e-4)) <= set(item.sparse.indices.tolist())


# --- Hub allow-patterns ----------------------------------------------------------------------------


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_download_patterns_take_every_file_of_a_bin_and_vocab_repo(tmp_path, minilm_dir):
    folder = vocab_folder(tmp_path, minilm_dir)
    (folder / "pytorch_model.bin").write_bytes(b"")
    files = listing(folder)
    assert sorted(filter_repo_objects(files, allow_patterns=download_patterns(files))) == files


def test_download_patterns_take_safetensors_over_bin_per_folder_and_every_module_file():
    files = [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "tf_model.h5",
        "rust_model.ot",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.txt",
        "merges.txt",
        "vocab.json",
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/pytorch_model.bin",
        "3_Dense/config.json",
        "3_Dense/model.safetensors",
        "3_Dense/pytorch_model.bin",
        "onnx/model.onnx",
        "openvino/openvino_model.bin",
        "openvino/openvino_model.xml",
        "README.md",
        "colbert_linear.pt",
        "sparse_linear.pt",
    ]
    selected = set(filter_repo_objects(files, allow_patterns=download_patterns(files)))
    skipped = {
        "pytorch_model.bin",
        "3_Dense/pytorch_model.bin",
        "tf_model.h5",
        "rust_model.ot",
        "onnx/model.onnx",
        "openvino/openvino_model.bin",
        "openvino/openvino_model.xml",
        "README.md",
    }
    assert selected == set(files) - skipped


def test_a_sentence_transformers_folder_cut_to_the_download_patterns_loads_the_same(tmp_path):
    """Everything the loader reads of a folder with Pooling, Dense and Normalize modules is in the
    patterns: a copy holding only the selected files gives the same vectors."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    full = tmp_path / "full"
    encoder = full / "encoder"
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertModel(config).save_pretrained(encoder)
    minilm = resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)
    transformers.AutoTokenizer.from_pretrained(minilm).save_pretrained(encoder)
    modules = [Transformer(str(encoder), max_seq_length=64), Pooling(32, pooling_mode="cls"), Dense(32, 8), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(full / "repo"))
    repo = full / "repo"
    (repo / "onnx").mkdir()
    (repo / "onnx" / "model.onnx").write_bytes(b"not read")
    files = listing(repo)
    cut = tmp_path / "cut"
    for name in filter_repo_objects(files, allow_patterns=download_patterns(files)):
        (cut / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / name, cut / name)
    assert not (cut / "onnx").exists() and (cut / "2_Dense" / "model.safetensors").exists()

    card = {"architecture": "bert", "max_length": 64, "pooling": "cls", "normalize": True, "dimensions": 8}
    full_items = engine_encode(tmp_path, {**card, "id": "local/full", "source": {"path": str(repo)}})
    cut_items = engine_encode(tmp_path, {**card, "id": "local/cut", "source": {"path": str(cut)}})
    expected = SentenceTransformer(str(repo), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(np.stack([i.dense for i in cut_items]), expected, atol=2e-5)
    # The same weights; float32's last bits may differ, as the device's two lanes may split the texts
    # into different batches in the two runs.
    np.testing.assert_allclose(
        np.stack([i.dense for i in cut_items]), np.stack([i.dense for i in full_items]), rtol=1e-5, atol=1e-6
    )


def test_download_patterns_take_an_open_clip_checkpoint_only_where_no_transformers_one_is():
    laion = ["config.json", "model.safetensors", "pytorch_model.bin", "open_clip_config.json",
             "open_clip_model.safetensors", "open_clip_pytorch_model.bin", "tokenizer.json"]  # fmt: skip
    selected = set(filter_repo_objects(laion, allow_patterns=download_patterns(laion)))
    assert selected == {"config.json", "model.safetensors", "open_clip_config.json", "tokenizer.json"}
    pure = ["open_clip_config.json", "open_clip_pytorch_model.bin", "README.md"]
    assert set(filter_repo_objects(pure, allow_patterns=download_patterns(pure))) == {
        "open_clip_config.json",
        "open_clip_pytorch_model.bin",
    }
