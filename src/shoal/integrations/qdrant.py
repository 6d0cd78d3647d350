"""Qdrant: `ShoalHybrid`, a hybrid collection of shoal's dense vectors (an embedder) and sparse ones
(a SPLADE model) side by side in each point, and queries that fuse both rankings by Reciprocal
Rank Fusion in one Query API call (a prefetch per vector, then RRF).

    from qdrant_client import QdrantClient
    from shoal.integrations.qdrant import ShoalHybrid
    hybrid = ShoalHybrid(QdrantClient(":memory:"), "docs", url="http://127.0.0.1:8080",
                         dense_model="BAAI/bge-small-en-v1.5", sparse_model="rasyosef/splade-tiny")
    hybrid.create_collection()  # dense size from the server's model entry
    hybrid.upsert(["shoals of small fish", "a reef at dusk"], payloads=[{"i": 0}, {"i": 1}])
    hybrid.query("fish", limit=1)[0].payload   # {"i": 0}

One model can be both (BGE-M3: `dense_model=sparse_model="BAAI/bge-m3"`): then one encode call
gives both outputs.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from qdrant_client import QdrantClient, models

from ..errors import ConfigError, InvalidRequest
from ..sdk import Client


class ShoalHybrid:
    """The collection `collection` of `qdrant`, with a named dense vector (`dense_name`) and a named
    sparse one (`sparse_name`) per point, filled and queried through the shoal server at `url`.

    Texts are encoded `batch_size` at a time and upserted as they come; queries are encoded with
    `is_query=True`, so a card's query prompt applies.
    """

    def __init__(
        self,
        qdrant: QdrantClient,
        collection: str,
        *,
        url: str,
        dense_model: str,
        sparse_model: str,
        api_key: str | None = None,
        dense_name: str = "dense",
        sparse_name: str = "sparse",
        dimensions: int | None = None,
        batch_size: int = 64,
        **client: Any,
    ) -> None:
        self.qdrant, self.collection = qdrant, collection
        self.dense_model, self.sparse_model = dense_model, sparse_model
        self.dense_name, self.sparse_name = dense_name, sparse_name
        self.dimensions, self.batch_size = dimensions, batch_size
        self.client = Client(url, api_key=api_key, **client)

    def create_collection(self, *, distance: models.Distance = models.Distance.COSINE, **options: Any) -> None:
        """Create the collection: the dense vector sized as the server says (or `dimensions`), the
        sparse one as is (SPLADE weights are already term weights: no IDF modifier)."""
        num_dims = self.dimensions or self.client.model(self.dense_model)["dimensions"]
        if num_dims is None:
            raise ConfigError(f"model {self.dense_model!r} has no dense dimensions: pass dimensions= or a dense model")
        self.qdrant.create_collection(
            self.collection,
            vectors_config={self.dense_name: models.VectorParams(size=num_dims, distance=distance)},
            sparse_vectors_config={self.sparse_name: models.SparseVectorParams()},
            **options,
        )

    def vectors(self, texts: Sequence[str], *, is_query: bool) -> list[dict[str, Any]]:
        """Each text's named vectors: `{dense_name: [d] floats, sparse_name: SparseVector}`."""
        texts = list(texts)
        if self.dense_model == self.sparse_model:
            both = self.client.encode(
                self.dense_model,
                texts,
                outputs=["dense", "sparse"],
                dimensions=self.dimensions,
                is_query=is_query,
                batch_size=self.batch_size,
            )
            dense, sparse = both.dense_rows(), both.sparse
        else:
            dense = self.client.encode(
                self.dense_model,
                texts,
                outputs=["dense"],
                dimensions=self.dimensions,
                is_query=is_query,
                batch_size=self.batch_size,
            ).dense_rows()
            sparse = self.client.encode(
                self.sparse_model, texts, outputs=["sparse"], is_query=is_query, batch_size=self.batch_size
            ).sparse
        if sparse is None:
            raise InvalidRequest(
                f"model {self.sparse_model!r} returned no sparse vectors: is it a sparse (SPLADE) model?"
            )
        return [
            {
                self.dense_name: row.tolist(),
                self.sparse_name: models.SparseVector(indices=s.indices.tolist(), values=s.values.tolist()),
            }
            for row, s in zip(dense, sparse)
        ]

    def upsert(
        self,
        texts: Sequence[str],
        *,
        ids: Sequence[int | str] | None = None,
        payloads: Sequence[dict[str, Any]] | None = None,
    ) -> list[int | str]:
        """Add (or replace, by id) one point per text; ids default to new UUIDs. Returns the ids."""
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not one str: pass [text]")
        ids = list(ids) if ids is not None else [str(uuid.uuid4()) for _ in texts]
        payloads = list(payloads) if payloads is not None else [{} for _ in texts]
        if not len(ids) == len(payloads) == len(texts):
            raise ValueError(f"{len(texts)} texts, but {len(ids)} ids and {len(payloads)} payloads")
        for start in range(0, len(texts), self.batch_size):
            end = start + self.batch_size
            points = [
                models.PointStruct(id=i, vector=v, payload=p)
                for i, v, p in zip(ids[start:end], self.vectors(texts[start:end], is_query=False), payloads[start:end])
            ]
            self.qdrant.upsert(self.collection, points=points)
        return ids

    def query(
        self,
        text: str,
        *,
        limit: int = 10,
        prefetch_limit: int | None = None,
        query_filter: models.Filter | None = None,
        **options: Any,
    ) -> list[models.ScoredPoint]:
        """The `limit` best points for `text`: the `prefetch_limit` (default max(4 * limit, 20)) best
        by each vector, fused by RRF; `query_filter` applies to both prefetches."""
        vectors = self.vectors([text], is_query=True)[0]
        candidates = prefetch_limit or max(4 * limit, 20)
        prefetch = [
            models.Prefetch(query=vectors[name], using=name, limit=candidates, filter=query_filter)
            for name in (self.dense_name, self.sparse_name)
        ]
        return self.qdrant.query_points(
            self.collection,
            prefetch=prefetch,
            query=models.FusionQuery(fusion=models.Fusion.RRF),
            limit=limit,
            **options,
        ).points

    def close(self) -> None:
        """Close the shoal client (the Qdrant client stays the caller's)."""
        self.client.close()
