"""What the SDK returns: numpy arrays and small typed records, built from the wire's responses.

msgpack carries arrays as `{dtype, shape, data}` (decoded by `wire.array_from_msgpack`, dtype
kept); JSON as nested lists, read back in the dtype the request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, cast

import numpy as np

from .. import wire
from ..calls import ExtractedItem
from ..errors import InvalidRequest

# JSON lists back to arrays: the dtype each `output_dtype` is sent in (ubinary: packed sign bits
# as uint8; binary: the same less 128, as int8).
JSON_DTYPES: dict[str, type[np.generic]] = {
    "float32": np.float32,
    "float16": np.float16,
    "int8": np.int8,
    "binary": np.int8,
    "ubinary": np.uint8,
}


class Sparse(NamedTuple):
    indices: np.ndarray  # [k] int32 vocabulary ids, heaviest first
    values: np.ndarray  # [k] float32 weights


@dataclass(frozen=True)
class Encoded:
    """One `encode` call's outputs, one row per text in the order sent; an output not asked for is None."""

    model: str
    dense: np.ndarray | None  # [n, dims] (binary: [n, dims / 8] int8; ubinary: uint8)
    sparse: list[Sparse] | None
    multivector: list[np.ndarray] | None  # each [tokens kept, dim]
    num_tokens: int
    sparse_tokens: list[list[str]] | None = None  # with return_tokens=True: the token of each index

    def dense_rows(self) -> np.ndarray:
        """`dense`, or an InvalidRequest when the model sent none (it is not a dense embedder)."""
        if self.dense is None:
            raise InvalidRequest(f"model {self.model!r} returned no dense vectors: is it a dense embedder?")
        return self.dense


class Scored(NamedTuple):
    # The position in the documents sent; the public name hides tuple.index.
    index: int  # type: ignore[assignment]
    score: float


class Ranking(list[Scored]):
    """`Scored(index, score)` pairs, best first (a list: `ranking[0].index`, `for i, s in ranking`);
    `truncated` are the indices of documents cut to fit the model."""

    def __init__(self, items: list[Scored], *, model: str, num_tokens: int, truncated: frozenset[int]) -> None:
        super().__init__(items)
        self.model = model
        self.num_tokens = num_tokens
        self.truncated = truncated


def array_of(value: object, json_dtype: type[np.generic]) -> np.ndarray:
    """A msgpack `{dtype, shape, data}` map or a JSON (nested) list as an array."""
    if isinstance(value, dict):
        return wire.array_from_msgpack(cast(wire.MsgpackArray, value))  # the only map an array is sent as
    return np.asarray(value, dtype=json_dtype)


def encoded(responses: list[wire.EncodeResponse], output_dtype: str) -> Encoded:
    """Join the answers to one call's chunks (in the order sent) into one `Encoded`."""
    dtype = JSON_DTYPES[output_dtype]
    dense: list[np.ndarray] = []
    sparse: list[Sparse] = []
    sparse_tokens: list[list[str]] = []
    multivector: list[np.ndarray] = []
    for item in (item for response in responses for item in response.items):
        if item.dense is not None:
            dense.append(array_of(item.dense, dtype))
        if item.sparse is not None:
            sparse.append(Sparse(array_of(item.sparse.indices, np.int32), array_of(item.sparse.values, np.float32)))
            if item.sparse.tokens is not None:
                sparse_tokens.append(item.sparse.tokens)
        if item.multivector is not None:
            multivector.append(array_of(item.multivector, np.float32))
    return Encoded(
        model=responses[0].model,
        dense=np.stack(dense) if dense else None,
        sparse=sparse or None,
        multivector=multivector or None,
        num_tokens=sum(r.usage.tokens for r in responses),
        sparse_tokens=sparse_tokens or None,
    )


def ranking(response: wire.ScoreResponse) -> Ranking:
    items = [Scored(item.index, item.score) for item in response.items]
    truncated = frozenset(item.index for item in response.items if item.truncated)
    return Ranking(items, model=response.model, num_tokens=response.usage.tokens, truncated=truncated)


def extracted(responses: list[wire.ExtractResponse]) -> list[ExtractedItem]:
    """Each text's entities or labels, in the order sent, across the call's chunks."""
    return [
        ExtractedItem(
            entities=item.entities,
            labels=item.labels,
            classifications=item.classifications,
            relations=item.relations,
            structures=item.structures,
            num_windows=item.num_windows,
            truncated=item.truncated,
        )
        for response in responses
        for item in response.items
    ]
