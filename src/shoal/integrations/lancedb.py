"""LanceDB: the "shoal" entry of LanceDB's embedding registry, so a table's schema embeds its source
column on a shoal server on `add` and its queries (with `is_query=True`) on `search`.

    import lancedb
    from lancedb.embeddings import get_registry
    from lancedb.pydantic import LanceModel, Vector
    import shoal.integrations.lancedb  # registers "shoal"
    embed = get_registry().get("shoal").create(url="http://127.0.0.1:8080", model="BAAI/bge-small-en-v1.5")
    class Doc(LanceModel):
        text: str = embed.SourceField()
        vector: Vector(embed.ndims()) = embed.VectorField()
    table = lancedb.connect("/tmp/db").create_table("docs", schema=Doc)
    table.add([{"text": "shoals of small fish"}]); table.search("fish").limit(1).to_pydantic(Doc)

`api_key` is one of LanceDB's sensitive keys: pass it as `"$var:NAME"` after
`get_registry().set_var("NAME", key)`, so the table's saved config holds the variable, not the key.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from lancedb.embeddings import TextEmbeddingFunction, register
from pydantic import PrivateAttr

from ..errors import ConfigError
from ..sdk import Client


@register("shoal")
class ShoalEmbeddingFunction(TextEmbeddingFunction):
    """Dense vectors of `model` from the shoal server at `url`; `dimensions` truncates Matryoshka
    vectors (and is what `ndims()` answers; otherwise the server's model entry says)."""

    url: str
    model: str
    api_key: str | None = None

    @staticmethod
    def sensitive_keys() -> list[str]:
        """LanceDB refuses to store these in a table's config unless given as `$var:NAME`."""
        return ["api_key"]

    dimensions: int | None = None
    batch_size: int = 64
    adapter: str | None = None
    # The SDK already retries what is worth retrying (overload, transport) under its deadline;
    # LanceDB's own wrapper would retry every error, a wrong model id included, for minutes.
    max_retries: int = 0
    _client: Client | None = PrivateAttr(default=None)
    _num_dims: int | None = PrivateAttr(default=None)

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, api_key=self.api_key)
        return self._client

    def ndims(self) -> int:
        if self._num_dims is None:
            num_dims = self.dimensions or self.client.model(self.model)["dimensions"]
            if num_dims is None:
                raise ConfigError(f"model {self.model!r} has no dense dimensions: pass dimensions= or a dense model")
            self._num_dims = num_dims
        return self._num_dims

    # Rows are never None; the element type is the base class's (`list[np.array | None]`).
    def _encode(self, texts: list[str], is_query: bool) -> list[np.ndarray | None]:
        if not texts:
            return []
        dense = self.client.encode(
            self.model,
            texts,
            is_query=is_query,
            dimensions=self.dimensions,
            batch_size=self.batch_size,
            adapter=self.adapter,
        ).dense_rows()
        return list(dense.astype(np.float32, copy=False))  # n rows of [dims]

    def generate_embeddings(self, texts: list[str] | np.ndarray, *args: Any, **kwargs: Any) -> list[np.ndarray | None]:
        return self._encode([str(t) for t in texts], is_query=False)

    def compute_query_embeddings(self, query: str, *args: Any, **kwargs: Any) -> list[np.ndarray | None]:
        return self._encode(list(self.sanitize_input(query)), is_query=True)

    # The client owns an event-loop thread, which neither copies nor pickles: a copy builds its own.
    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> ShoalEmbeddingFunction:
        copied = self.model_copy()  # every field is a str, int or None: shallow is deep
        copied._client = None
        return copied

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()
        state["__pydantic_private__"] = {**(state.get("__pydantic_private__") or {}), "_client": None}
        return state
