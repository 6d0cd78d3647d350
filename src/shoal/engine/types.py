"""The padding-free `Batch`, the contract between scheduling and compute; the preprocessed
sequence (`Encoded`) it packs; and the per-sequence head spec that tells the backend which
outputs one sequence wants. No torch, no tokenizers here.

A sequence is token ids (what the scheduler counts and budgets) plus optional feature slots: host
arrays a model reads beside the ids, such as an image's patch pixels. A preprocessor that makes
feature rows gives each row a position among the ids (a placeholder id per patch), so the rows
count as tokens in every budget. Text has none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np


@dataclass(frozen=True, slots=True)
class Encoded:
    """One preprocessed sequence (a text, a text pair as one sequence; an image's patches later)."""

    ids: np.ndarray  # [n] int64, special tokens included
    type_ids: np.ndarray | None = None  # [n] int64 segment ids; None: all zero (a single text)
    offsets: np.ndarray | None = None  # [n, 2] int32 character spans into their text; (0, 0) for specials
    word_ids: np.ndarray | None = None  # [n] int32 word index; -1 for special tokens
    truncated: bool = False  # tokens of its text (or of a pair's second text) were cut off
    # Tokens past the first `num_keys` are attended by none (ColBERT's [MASK] query expansion),
    # though they get outputs; None: every token is attended to.
    num_keys: int | None = None
    # Feature slots by name: `[rows, ...]` host arrays the model reads beside the ids (an image's
    # `[patches, channels*patch*patch]` pixels); empty for text.
    features: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class FeatureSlot:
    """One feature slot of a batch: every sequence's rows, concatenated in sequence order."""

    values: np.ndarray  # [R, ...] the rows of all sequences that carry this slot
    cu_rows: np.ndarray  # [n+1] int32 cumulative rows per sequence (0 rows: the sequence has none)


class PhaseSeconds(TypedDict):
    """How long a request spent in each phase: the timings a task's `collect` puts in its result."""

    tokenize_s: float
    queue_s: float
    inference_s: float


@dataclass(frozen=True)
class EncodeSpec:
    """What one sequence's outputs should look like, resolved against the card."""

    normalize: bool
    dimensions: int | None
    output_dtype: str
    outputs: tuple[str, ...] = ("dense",)
    is_query: bool = False
    sparse_top_k: int | None = None
    return_tokens: bool = False
    # Leading tokens of the sequence that its prompt made (counted as sentence-transformers does:
    # the prompt tokenized alone, less a trailing special token); the dense head leaves them out
    # of pooling when the model's Pooling module says `include_prompt: false`.
    prompt_tokens: int = 0


@dataclass(frozen=True)
class ScoreSpec:
    """A reranker sequence (a query-document pair): its score, activated unless `raw`."""

    raw: bool = False
    outputs: tuple[str, ...] = ("score",)
    is_query: bool = False


@dataclass(frozen=True)
class ExtractSpec:
    """An extraction sequence and what its head needs.

    entities (GLiNER): positions in the sequence of each text word's first (or last) token
    (`word_tokens` `[w]`) and of each label's prompt token (`prompt_tokens` `[c]`); the head
    returns the candidate spans scoring above `threshold` no wider than `max_width` words that
    start in `owned`.
    token_logits (token classifiers) and nli (zero-shot classification) need nothing more.
    """

    outputs: tuple[str, ...]  # ("entities",), ("token_logits",) or ("nli",)
    word_tokens: np.ndarray | None = None
    prompt_tokens: np.ndarray | None = None
    threshold: float = 0.5
    max_width: int = 12
    owned: tuple[int, int] | None = None  # gliner: the span starts (words) this window answers for
    is_query: bool = False


@dataclass(frozen=True)
class GenerateSpec:
    """What one generated sequence asks for (a generating model runs it on its generation loop,
    engine/generation.py, not in device batches). `constraint`: ("json_schema", schema),
    ("json_object", None), ("regex", pattern), ("choice", options) or None."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    constraint: tuple[str, Any] | None = None


Spec = EncodeSpec | ScoreSpec | ExtractSpec  # a device batch's; a generation has a GenerateSpec


@dataclass(frozen=True)
class Batch:
    """A padding-free batch: n sequences packed into T tokens."""

    input_ids: np.ndarray  # [T] int64
    position_ids: np.ndarray  # [T] int64, restarting at 0 for each sequence
    cu_seqlens: np.ndarray  # [n+1] int32, cumulative sequence boundaries
    max_seqlen: int
    token_type_ids: np.ndarray | None = None  # [T] int64 segment ids; None: all zero
    # [n] int32 per-sequence LoRA adapter slot (-1: the base model); None: no sequence uses one.
    adapter_slots: np.ndarray | None = None
    # [n] int32 keys per sequence: tokens past its first key_lengths[i] are attended by none
    # (`Encoded.num_keys`); None: every token of every sequence is attended to.
    key_lengths: np.ndarray | None = None
    features: Mapping[str, FeatureSlot] = field(default_factory=dict)  # by slot name; empty for text

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.shape[0] - 1)

    @classmethod
    def pack(cls, seqs: Sequence[Encoded], adapter_slots: Sequence[int] | None = None) -> Batch:
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        cu = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        total = int(cu[-1])
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lengths)
        type_ids = None
        if any(s.type_ids is not None for s in seqs):
            type_ids = np.concatenate(
                [s.type_ids if s.type_ids is not None else np.zeros(len(s), np.int64) for s in seqs]
            )
        slots = None
        if adapter_slots is not None and any(slot >= 0 for slot in adapter_slots):
            slots = np.asarray(adapter_slots, dtype=np.int32)
        key_lengths = None
        if any(s.num_keys is not None for s in seqs):
            key_lengths = np.asarray([len(s) if s.num_keys is None else s.num_keys for s in seqs], dtype=np.int32)
        input_ids = np.concatenate([s.ids for s in seqs]).astype(np.int64, copy=False)
        return cls(input_ids, position_ids, cu, int(lengths.max()), type_ids, slots, key_lengths, _features(seqs))


def _features(seqs: Sequence[Encoded]) -> dict[str, FeatureSlot]:
    names = sorted({name for s in seqs for name in s.features})
    slots = {}
    for name in names:
        parts = [s.features.get(name) for s in seqs]
        present = next(p for p in parts if p is not None)
        for p in parts:  # one slot is one array: the same dtype and row shape in every sequence
            if p is not None and (p.dtype != present.dtype or p.shape[1:] != present.shape[1:]):
                raise ValueError(
                    f"feature slot {name!r}: rows of {p.dtype} {p.shape[1:]} beside rows of "
                    f"{present.dtype} {present.shape[1:]}; a preprocessor must give one dtype and row shape"
                )
        rows = np.fromiter((0 if p is None else len(p) for p in parts), dtype=np.int64, count=len(parts))
        cu_rows = np.zeros(len(parts) + 1, dtype=np.int32)
        np.cumsum(rows, out=cu_rows[1:])
        values = np.concatenate([p for p in parts if p is not None]) if rows.any() else present[:0]
        slots[name] = FeatureSlot(values, cu_rows)
    return slots
