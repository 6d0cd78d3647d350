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
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None

    def texts(self) -> list[str]:
        texts = [self.input] if isinstance(self.input, str) else self.input
        if not texts:
            raise InvalidRequest("`input` is empty: send a string or a non-empty list of strings")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"`input[{i}]` is {type(text).__name__}: only text input is supported, "
                    "send strings rather than token ids",
                    details={"path": f"$.input[{i}]"},
                )
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
