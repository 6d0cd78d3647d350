"""Engine types: what the API hands the engine, what the scheduler queues, and the padding-free
`Batch` that is the contract between scheduling and compute. No torch here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class EncodeSpec:
    """What one item's outputs should look like, resolved against the card."""

    normalize: bool
    dimensions: int | None
    output_dtype: str
    outputs: tuple[str, ...] = ("dense",)
    is_query: bool = False
    sparse_top_k: int | None = None
    return_tokens: bool = False


@dataclass(frozen=True)
class EncodeCall:
    """An encode request in engine terms (the API builds it from the wire type)."""

    model: str
    texts: list[str]
    normalize: bool | None = None
    dimensions: int | None = None
    output_dtype: str = "float32"
    is_query: bool | None = None
    prompt_name: str | None = None
    truncate: bool = True
    outputs: tuple[str, ...] | None = None  # None: the card's first output
    sparse_top_k: int | None = None
    return_tokens: bool = False


@dataclass(frozen=True)
class SparseVector:
    indices: np.ndarray  # [k] int32 vocabulary ids, heaviest first
    values: np.ndarray  # [k] float32
    tokens: list[str] | None = None


@dataclass(frozen=True)
class ItemResult:
    """One item's outputs; those not asked for are None."""

    dense: np.ndarray | None = None  # [dims]
    sparse: SparseVector | None = None
    multivector: np.ndarray | None = None  # [tokens kept, dim]


@dataclass(frozen=True)
class EncodeResult:
    items: list[ItemResult]
    num_tokens: int
    tokenize_s: float
    queue_s: float
    inference_s: float

    @property
    def vectors(self) -> list[np.ndarray]:
        """The dense vectors, in item order."""
        return [item.dense for item in self.items]


_sequence_numbers = itertools.count()


@dataclass(eq=False)
class WorkItem:
    """One sequence waiting for the device. The scheduler reads `model_id`, `num_tokens`, `seq`."""

    model_id: str
    token_ids: np.ndarray  # [num_tokens] int64
    spec: EncodeSpec
    future: asyncio.Future
    runner: Any  # the loaded model; held (refcounted) by the request until it answers
    enqueued_at: float = field(default_factory=time.perf_counter)
    seq: int = field(default_factory=lambda: next(_sequence_numbers))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def cancelled(self) -> bool:
        return self.future.done()


@dataclass(frozen=True)
class ItemOutput:
    result: ItemResult
    queue_s: float
    inference_s: float


@dataclass(frozen=True)
class Batch:
    """A padding-free batch: n sequences packed into T tokens."""

    input_ids: np.ndarray  # [T] int64
    position_ids: np.ndarray  # [T] int64, restarting at 0 for each sequence
    cu_seqlens: np.ndarray  # [n+1] int32, cumulative sequence boundaries
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.shape[0] - 1)

    @classmethod
    def pack(cls, sequences: list[np.ndarray]) -> "Batch":
        lengths = np.fromiter((s.shape[0] for s in sequences), dtype=np.int64, count=len(sequences))
        cu = np.zeros(len(sequences) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        total = int(cu[-1])
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lengths)
        return cls(np.concatenate(sequences).astype(np.int64, copy=False), position_ids, cu, int(lengths.max()))
