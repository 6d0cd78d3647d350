"""OpenAI-compatible `/v1/embeddings`: request, response, and its base64 vector format."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import msgspec
import numpy as np

from ..errors import InvalidRequest


class EmbeddingsRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    # Strings, or token ids (refused with a clear message): never arbitrarily nested.
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"  # null: float
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
    # shoal's own (send them with the openai client's `extra_body`): the card's query or document
    # prompt (`input_type`: query, document, or Cohere's search_query, search_document), or a
    # prompt by name; OpenAI has no such field, so without them texts go unprefixed.
    input_type: Literal["query", "document", "search_query", "search_document"] | None = None
    prompt_name: str | None = None
    # shoal's own too: false refuses a text longer than the model takes (422) instead of cutting it;
    # either way the x-shoal-truncated answer header lists the inputs that were cut.
    truncate: bool | None = None

    @property
    def format(self) -> str:
        return self.encoding_format or "float"

    @property
    def is_query(self) -> bool | None:
        return None if self.input_type is None else self.input_type in ("query", "search_query")

    def texts(self) -> list[str]:
        given = [self.input] if isinstance(self.input, str) else self.input
        if not given:
            raise InvalidRequest("`input` is empty: send a string or a non-empty list of strings")
        texts: list[str] = []
        for i, text in enumerate(given):
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"`input[{i}]` is {'token ids' if isinstance(text, list) else type(text).__name__}: "
                    "shoal takes text, not token ids, because each model has its own tokenizer. "
                    "langchain-openai sends token ids unless told not to: construct "
                    "`OpenAIEmbeddings(..., check_embedding_ctx_length=False)`; other clients: send strings",
                    details={"path": f"$.input[{i}]"},
                )
            texts.append(text)
        return texts


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingsUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage
    object: str = "list"


def openai_embedding(index: int, vector: np.ndarray, encoding_format: str) -> Embedding:
    """OpenAI's base64 format is the float32 little-endian bytes of the vector."""
    if encoding_format == "base64":
        raw = np.ascontiguousarray(vector, dtype="<f4").tobytes()
        return Embedding(index=index, embedding=base64.b64encode(raw).decode("ascii"))
    return Embedding(index=index, embedding=vector.astype(np.float32).tolist())
