"""Haystack: `ShoalTextEmbedder` and `ShoalDocumentEmbedder` (queries and documents with the card's
prompts) and `ShoalRanker` (documents reordered by shoal's `score`), components for a `Pipeline`.

    from haystack import Pipeline
    from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever
    from shoal.integrations.haystack import ShoalDocumentEmbedder, ShoalRanker, ShoalTextEmbedder
    store.write_documents(ShoalDocumentEmbedder(url=URL, model=MODEL).run(documents)["documents"])
    search = Pipeline()
    search.add_component("embed", ShoalTextEmbedder(url=URL, model=MODEL))
    search.add_component("retrieve", InMemoryEmbeddingRetriever(store, top_k=10))
    search.add_component("rank", ShoalRanker(url=URL, model="BAAI/bge-reranker-base", top_k=3))
    search.connect("embed.embedding", "retrieve.query_embedding"); search.connect("retrieve", "rank")
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from haystack import Document, component
from haystack.utils import Secret

from ..sdk import AsyncClient, Client, Ranking


class _Shoal:
    """What the three components share: the server, the model and a lazily opened client. Init
    parameters are kept under their own names, so Haystack's default `to_dict` serialises them
    (a `Secret` as its env var; a token secret refuses to serialise)."""

    def __init__(self, url: str, model: str, api_key: Secret | None = None) -> None:
        self.url, self.model, self.api_key = url, model, api_key
        self._client: Client | None = None

    def _token(self) -> str | None:
        return self.api_key.resolve_value() if self.api_key is not None else None

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, api_key=self._token())
        return self._client

    def _aclient(self) -> AsyncClient:
        return AsyncClient(self.url, api_key=self._token())  # one per event loop


class _Embedder(_Shoal):
    def __init__(
        self,
        url: str,
        model: str,
        api_key: Secret | None = None,
        dimensions: int | None = None,
        batch_size: int = 64,
        adapter: str | None = None,
    ) -> None:
        super().__init__(url, model, api_key)
        self.dimensions, self.batch_size, self.adapter = dimensions, batch_size, adapter

    def _options(self, is_query: bool) -> dict[str, Any]:
        return dict(is_query=is_query, dimensions=self.dimensions, batch_size=self.batch_size, adapter=self.adapter)

    def _encode(self, texts: list[str], is_query: bool) -> list[list[float]]:
        return self.client.encode(self.model, texts, **self._options(is_query)).dense_rows().astype(float).tolist()

    async def _aencode(self, texts: list[str], is_query: bool) -> list[list[float]]:
        async with self._aclient() as client:
            result = await client.encode(self.model, texts, **self._options(is_query))
        return result.dense_rows().astype(float).tolist()


@component
class ShoalTextEmbedder(_Embedder):
    """A query's dense vector (`is_query=True`): `run(text)` -> {"embedding": [d floats]}."""

    @component.output_types(embedding=list[float], meta=dict[str, Any])
    def run(self, text: str) -> dict[str, Any]:
        return {"embedding": self._encode([text], is_query=True)[0], "meta": {"model": self.model}}

    @component.output_types(embedding=list[float], meta=dict[str, Any])
    async def run_async(self, text: str) -> dict[str, Any]:
        return {"embedding": (await self._aencode([text], is_query=True))[0], "meta": {"model": self.model}}


@component
class ShoalDocumentEmbedder(_Embedder):
    """Documents' dense vectors (`is_query=False`): `run(documents)` -> {"documents": copies with
    `.embedding` set}, in the order given."""

    @staticmethod
    def _embedded(documents: list[Document], vectors: list[list[float]]) -> dict[str, Any]:
        return {"documents": [replace(d, embedding=v) for d, v in zip(documents, vectors, strict=True)]}

    @component.output_types(documents=list[Document], meta=dict[str, Any])
    def run(self, documents: list[Document]) -> dict[str, Any]:
        vectors = self._encode([d.content or "" for d in documents], is_query=False) if documents else []
        return {**self._embedded(documents, vectors), "meta": {"model": self.model}}

    @component.output_types(documents=list[Document], meta=dict[str, Any])
    async def run_async(self, documents: list[Document]) -> dict[str, Any]:
        vectors = await self._aencode([d.content or "" for d in documents], is_query=False) if documents else []
        return {**self._embedded(documents, vectors), "meta": {"model": self.model}}


@component
class ShoalRanker(_Shoal):
    """Documents reordered by a shoal reranker (or any model that scores), best first, each copy's
    `.score` set to shoal's score; `top_k` (here or per run) keeps the best k (None: all)."""

    def __init__(self, url: str, model: str, api_key: Secret | None = None, top_k: int | None = None) -> None:
        _Shoal.__init__(self, url, model, api_key)  # not super(): @component rebuilds the class
        self.top_k = top_k

    @staticmethod
    def _ranked(documents: list[Document], ranking: Ranking) -> dict[str, list[Document]]:
        return {"documents": [replace(documents[index], score=score) for index, score in ranking]}

    @component.output_types(documents=list[Document])
    def run(self, query: str, documents: list[Document], top_k: int | None = None) -> dict[str, list[Document]]:
        if not documents:
            return {"documents": []}
        ranking = self.client.score(
            self.model, query, [d.content or "" for d in documents], top_k=self.top_k if top_k is None else top_k
        )
        return self._ranked(documents, ranking)

    @component.output_types(documents=list[Document])
    async def run_async(
        self, query: str, documents: list[Document], top_k: int | None = None
    ) -> dict[str, list[Document]]:
        if not documents:
            return {"documents": []}
        async with self._aclient() as client:
            ranking = await client.score(
                self.model, query, [d.content or "" for d in documents], top_k=self.top_k if top_k is None else top_k
            )
        return self._ranked(documents, ranking)
