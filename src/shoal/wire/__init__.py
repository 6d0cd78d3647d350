"""Wire types: what crosses the HTTP boundary, one module per route family, in JSON or msgpack.

    codec         formats (Content-Type, Accept), encode/decode, array encoding, error bodies
    native        shoal's own verbs: encode, score, extract
    images        an image field, and its reading into the file's bytes (native's and Cohere's)
    models        the model list and model objects (OpenAI's shape, shoal's fields)
    openai        OpenAI's embeddings
    openai_chat   OpenAI's chat completions (and their SSE chunks)
    cohere        Cohere's (and Jina's) rerank, v1 and v2
    cohere_embed  Cohere's embed, v1 and v2
    tei           Hugging Face text-embeddings-inference's routes
    hf            Hugging Face Inference API task bodies on `POST /` (token, zero-shot, text classification)
    infinity      Infinity's rerank body on `/rerank` (TEI's route; the body picks the shape), `/classify`
    vllm          vLLM's score API on `/score`

Which route takes which type is the route table's to say (`shoal.api.table`).

Each family translates its requests to `shoal.calls` and results back. No torch, no web framework
here. The names below are re-exported so `wire.EncodeRequest`, `wire.decode` and friends work.
"""

from __future__ import annotations

from . import codec, cohere, cohere_embed, hf, images, infinity, models, native, openai, openai_chat, tei, vllm
from .codec import (
    JSON,
    MSGPACK,
    ErrorBody,
    ErrorResponse,
    Format,
    JSONObject,
    MsgpackArray,
    array_from_msgpack,
    array_to_msgpack,
    decode,
    encode,
    format_of_accept,
    format_of_content_type,
)
from .models import ModelEntry, ModelList
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
    usage_of,
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
    "JSONObject",
    "ModelEntry",
    "ModelList",
    "MsgpackArray",
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
    "usage_of",
    "array_from_msgpack",
    "array_to_msgpack",
    "codec",
    "cohere",
    "cohere_embed",
    "decode",
    "encode",
    "format_of_accept",
    "format_of_content_type",
    "hf",
    "images",
    "infinity",
    "models",
    "native",
    "openai",
    "openai_chat",
    "openai_embedding",
    "tei",
    "vllm",
]
