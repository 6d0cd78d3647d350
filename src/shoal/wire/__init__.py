"""Wire types: what crosses the HTTP boundary, one module per route family, in JSON or msgpack.

    codec     formats (Content-Type, Accept), encode/decode, array encoding, error bodies
    native    /v1/encode, /v1/score
    openai    /v1/embeddings
    cohere    /v1/rerank (Cohere v1 and Jina), /v2/rerank, /v1/embed, /v2/embed
    tei       /rerank

Each family translates its requests to `shoal.calls` and results back. No torch, no web framework
here. The names below are re-exported so `wire.EncodeRequest`, `wire.decode` and friends work.
"""

from __future__ import annotations

from . import codec, cohere, native, openai, tei
from .codec import (
    JSON,
    MSGPACK,
    ErrorBody,
    ErrorResponse,
    Format,
    array_from_msgpack,
    array_to_msgpack,
    decode,
    encode,
    format_of_accept,
    format_of_content_type,
)
from .native import (
    EncodedItem,
    EncodeItem,
    EncodeOptions,
    EncodeRequest,
    EncodeResponse,
    ExtractRequest,
    ExtractResponse,
    ItemId,
    OutputDtype,
    OutputKind,
    ScoredItem,
    ScoreItem,
    ScoreOptions,
    ScoreQuery,
    ScoreRequest,
    ScoreResponse,
    SparseOut,
    Timings,
    Usage,
)
from .openai import Embedding, EmbeddingsRequest, EmbeddingsResponse, EmbeddingsUsage, openai_embedding

__all__ = [
    "JSON",
    "MSGPACK",
    "Embedding",
    "EmbeddingsRequest",
    "EmbeddingsResponse",
    "EmbeddingsUsage",
    "EncodeItem",
    "EncodeOptions",
    "EncodeRequest",
    "EncodeResponse",
    "EncodedItem",
    "ExtractRequest",
    "ExtractResponse",
    "ErrorBody",
    "ErrorResponse",
    "Format",
    "ItemId",
    "OutputDtype",
    "OutputKind",
    "ScoreItem",
    "ScoreOptions",
    "ScoreQuery",
    "ScoreRequest",
    "ScoreResponse",
    "ScoredItem",
    "SparseOut",
    "Timings",
    "Usage",
    "array_from_msgpack",
    "array_to_msgpack",
    "codec",
    "cohere",
    "decode",
    "encode",
    "format_of_accept",
    "format_of_content_type",
    "native",
    "openai",
    "openai_embedding",
    "tei",
]
