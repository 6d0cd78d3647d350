"""Chroma: `ShoalEmbeddingFunction`, a chromadb `EmbeddingFunction` on a shoal server. Documents
are sent with `is_query=False`, `query_texts` with `is_query=True`, so a card's prompts apply.

    import chromadb
    from shoal.integrations.chroma import ShoalEmbeddingFunction
    embed = ShoalEmbeddingFunction(url="http://127.0.0.1:8080", model="BAAI/bge-small-en-v1.5")
    docs = chromadb.EphemeralClient().create_collection("docs", embedding_function=embed)
    docs.add(ids=["a", "b"], documents=["shoals of small fish", "a reef at dusk"])
    docs.query(query_texts=["fish"], n_results=1)["ids"]   # [["a"]]

Registered under the name "shoal", so a persisted collection reopens with its function from the
saved config (`url`, `model`, ...; an API key only by the name of its environment variable).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings, Space
from chromadb.utils.embedding_functions import register_embedding_function

from ..sdk import Client


@register_embedding_function
class ShoalEmbeddingFunction(EmbeddingFunction[Documents]):
    """Dense vectors of `model` from the shoal server at `url`, one float32 row per text.

    `api_key` is used but not saved in the collection's config; `api_key_env_var` names an
    environment variable holding it, and is saved. `dimensions` truncates Matryoshka vectors.
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        api_key_env_var: str | None = None,
        dimensions: int | None = None,
        batch_size: int = 64,
        adapter: str | None = None,
    ) -> None:
        self.url, self.model, self.dimensions, self.adapter = url, model, dimensions, adapter
        self.batch_size, self.api_key_env_var = batch_size, api_key_env_var
        if api_key is None and api_key_env_var is not None:
            api_key = os.environ.get(api_key_env_var)
        self._api_key = api_key
        self._client: Client | None = None  # built on first use: chroma builds instances just to compare configs

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, api_key=self._api_key)
        return self._client

    def _encode(self, texts: Documents, is_query: bool) -> Embeddings:
        if not texts:
            return []
        dense = self.client.encode(
            self.model,
            list(texts),
            is_query=is_query,
            dimensions=self.dimensions,
            batch_size=self.batch_size,
            adapter=self.adapter,
        ).dense_rows()
        return list(dense.astype(np.float32, copy=False))  # n rows of [dims]

    def __call__(self, input: Documents) -> Embeddings:
        return self._encode(input, is_query=False)

    def embed_query(self, input: Documents) -> Embeddings:
        return self._encode(input, is_query=True)

    @staticmethod
    def name() -> str:
        return "shoal"

    def default_space(self) -> Space:
        return "cosine"

    def get_config(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "api_key_env_var": self.api_key_env_var,
            "dimensions": self.dimensions,
            "batch_size": self.batch_size,
            "adapter": self.adapter,
        }

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> ShoalEmbeddingFunction:
        return ShoalEmbeddingFunction(**config)

    def validate_config_update(self, old_config: dict[str, Any], new_config: dict[str, Any]) -> None:
        for key in ("model", "dimensions", "adapter"):  # each changes the vectors already stored
            if key in new_config and new_config[key] != old_config.get(key):
                raise ValueError(
                    f"a collection's shoal {key} cannot change: its stored vectors came from {old_config.get(key)!r}"
                )
