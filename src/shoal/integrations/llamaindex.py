"""LlamaIndex: `ShoalEmbedding` (a `BaseEmbedding`: texts and queries with the card's prompts),
`ShoalMultiModalEmbedding` (a `MultiModalEmbedding`: the same texts, and images, for a model that
reads them: CLIP, SigLIP) and `ShoalRerank` (a `BaseNodePostprocessor` that reorders nodes by
shoal's `score`).

    from llama_index.core import Settings, VectorStoreIndex
    from shoal.integrations.llamaindex import ShoalEmbedding, ShoalRerank
    Settings.embed_model = ShoalEmbedding(url="http://127.0.0.1:8080", model="BAAI/bge-small-en-v1.5")
    index = VectorStoreIndex.from_documents(documents)
    rerank = ShoalRerank(url="http://127.0.0.1:8080", model="BAAI/bge-reranker-base", top_n=3)
    nodes = rerank.postprocess_nodes(index.as_retriever(similarity_top_k=10).retrieve(query), query_str=query)

    clip = ShoalMultiModalEmbedding(url="http://127.0.0.1:8080", model="openai/clip-vit-base-patch32")
    index = MultiModalVectorStoreIndex(nodes_and_image_nodes, embed_model=clip, image_embed_model=clip)
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr, SecretStr
from llama_index.core.embeddings import MultiModalEmbedding
from llama_index.core.embeddings.multi_modal_base import ImageType
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from ..sdk import AsyncClient, Client, Ranking


class ShoalEmbedding(BaseEmbedding):
    """Dense vectors from a shoal server: texts go with `is_query=False` and queries with
    `is_query=True`, so a card's document and query prompts (E5, BGE, Nomic...) apply.
    LlamaIndex cuts texts into requests of `embed_batch_size`."""

    url: str = Field(description="The shoal server's base URL.")
    # A secret: kept out of repr() and of serialised objects.
    api_key: SecretStr | None = Field(
        default=None, exclude=True, repr=False, description="Bearer token, if the server needs one."
    )
    dimensions: int | None = Field(default=None, description="Matryoshka truncation; None: the model's own.")
    adapter: str | None = Field(default=None, description="A LoRA adapter loaded on the server.")
    embed_batch_size: int = Field(default=64, gt=0, description="Texts per request.")
    _client: Client | None = PrivateAttr(default=None)

    def __init__(self, url: str, model: str, **fields: Any) -> None:
        # `url` by name: BaseEmbedding's __init__, as mypy synthesises it for a pydantic model, knows only
        # BaseEmbedding's own fields; pydantic's takes every field of this class.
        super().__init__(model_name=model, **{"url": url, **fields})

    @classmethod
    def class_name(cls) -> str:
        return "ShoalEmbedding"

    def _options(self) -> dict[str, Any]:
        return dict(dimensions=self.dimensions, adapter=self.adapter, batch_size=self.embed_batch_size)

    def _encode(self, texts: list[str], is_query: bool) -> list[Embedding]:
        if self._client is None:
            self._client = Client(self.url, api_key=_secret(self.api_key))
        result = self._client.encode(self.model_name, texts, is_query=is_query, **self._options())
        return result.dense_rows().astype(float).tolist()

    async def _aencode(self, texts: list[str], is_query: bool) -> list[Embedding]:
        async with AsyncClient(self.url, api_key=_secret(self.api_key)) as client:  # one per event loop
            result = await client.encode(self.model_name, texts, is_query=is_query, **self._options())
        return result.dense_rows().astype(float).tolist()

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._encode([query], is_query=True)[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await self._aencode([query], is_query=True))[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._encode([text], is_query=False)[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await self._aencode([text], is_query=False))[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._encode(texts, is_query=False) if texts else []

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await self._aencode(texts, is_query=False) if texts else []


class ShoalMultiModalEmbedding(ShoalEmbedding, MultiModalEmbedding):
    """`ShoalEmbedding`'s texts and queries, and images (`ImageType`: a file path or a BytesIO, as
    `ImageNode`s and `MultiModalVectorStoreIndex` pass them), from a model that reads images (CLIP,
    SigLIP). `get_image_embedding_batch` sends `embed_batch_size` images a request."""

    @classmethod
    def class_name(cls) -> str:
        return "ShoalMultiModalEmbedding"

    def _encode_images(self, images: list[ImageType]) -> list[Embedding]:
        if not images:
            return []
        if self._client is None:
            self._client = Client(self.url, api_key=_secret(self.api_key))
        result = self._client.encode(self.model_name, images=images, **self._options())
        return result.dense_rows().astype(float).tolist()

    async def _aencode_images(self, images: list[ImageType]) -> list[Embedding]:
        if not images:
            return []
        async with AsyncClient(self.url, api_key=_secret(self.api_key)) as client:  # one per event loop
            result = await client.encode(self.model_name, images=images, **self._options())
        return result.dense_rows().astype(float).tolist()

    def _get_image_embedding(self, img_file_path: ImageType) -> Embedding:
        return self._encode_images([img_file_path])[0]

    async def _aget_image_embedding(self, img_file_path: ImageType) -> Embedding:
        return (await self._aencode_images([img_file_path]))[0]

    def _get_image_embeddings(self, img_file_paths: list[ImageType]) -> list[Embedding]:
        return self._encode_images(img_file_paths)

    async def _aget_image_embeddings(self, img_file_paths: list[ImageType]) -> list[Embedding]:
        return await self._aencode_images(img_file_paths)


class ShoalRerank(BaseNodePostprocessor):
    """Nodes reordered by a shoal reranker (or any model that scores), best first, each
    `NodeWithScore.score` set to shoal's score; `top_n` keeps the best n (None: all)."""

    url: str = Field(description="The shoal server's base URL.")
    model: str = Field(description="The model that scores: a reranker, or an embedder (cosine).")
    top_n: int | None = Field(default=None, description="How many nodes to keep; None: all.")
    # A secret: kept out of repr() and of serialised objects.
    api_key: SecretStr | None = Field(
        default=None, exclude=True, repr=False, description="Bearer token, if the server needs one."
    )
    _client: Client | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "ShoalRerank"

    @staticmethod
    def _inputs(nodes: list[NodeWithScore], query_bundle: QueryBundle | None) -> tuple[str, list[str]]:
        """The query and the nodes' texts."""
        if query_bundle is None:
            raise ValueError("ShoalRerank needs the query: pass query_str or query_bundle")
        return query_bundle.query_str, [n.node.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]

    @staticmethod
    def _ranked(nodes: list[NodeWithScore], ranking: Ranking) -> list[NodeWithScore]:
        return [NodeWithScore(node=nodes[index].node, score=score) for index, score in ranking]

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        query, texts = self._inputs(nodes, query_bundle)
        if not texts:
            return []
        if self._client is None:
            self._client = Client(self.url, api_key=_secret(self.api_key))
        return self._ranked(nodes, self._client.score(self.model, query, texts, top_k=self.top_n))

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        query, texts = self._inputs(nodes, query_bundle)
        if not texts:
            return []
        async with AsyncClient(self.url, api_key=_secret(self.api_key)) as client:
            ranking = await client.score(self.model, query, texts, top_k=self.top_n)
        return self._ranked(nodes, ranking)


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()
