"""LangChain: `ShoalEmbeddings` (an `Embeddings`: documents and queries with the card's prompts, and
image files with `embed_image` for a model that reads images) and `ShoalRerank` (a
`BaseDocumentCompressor` that reorders documents by shoal's `score`).

    from shoal.integrations.langchain import ShoalEmbeddings, ShoalRerank
    embeddings = ShoalEmbeddings(url="http://127.0.0.1:8080", model="BAAI/bge-small-en-v1.5")
    store = InMemoryVectorStore.from_texts(texts, embeddings)
    rerank = ShoalRerank(url="http://127.0.0.1:8080", model="BAAI/bge-reranker-base", top_n=3)
    clip = ShoalEmbeddings(url="http://127.0.0.1:8080", model="openai/clip-vit-base-patch32")
    clip.embed_image(["cat.jpg", "dog.png"])   # the text side: clip.embed_query("a photo of a cat")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.embeddings import Embeddings
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from ..sdk import AsyncClient, Client


class ShoalEmbeddings(Embeddings):
    """Dense vectors from a shoal server: `embed_documents` sends `is_query=False` and `embed_query`
    `is_query=True`, so a card's document and query prompts (E5, BGE, Nomic...) apply.

    `embed_image(uris)` embeds image files (local paths, as langchain_experimental's
    `OpenCLIPEmbeddings` takes them, and as LangChain's Chroma `add_images` passes them) with a
    model that reads images (CLIP, SigLIP); a text-only model answers an InvalidRequest."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        dimensions: int | None = None,
        batch_size: int = 64,
        adapter: str | None = None,
        **client: Any,
    ) -> None:
        self.url, self.model, self.dimensions, self.batch_size, self.adapter = (
            url,
            model,
            dimensions,
            batch_size,
            adapter,
        )
        self._client_options = dict(api_key=api_key, **client)
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, **self._client_options)
        return self._client

    def _options(self) -> dict[str, Any]:
        return dict(dimensions=self.dimensions, batch_size=self.batch_size, adapter=self.adapter)

    def _encode(self, texts: Sequence[str], is_query: bool) -> list[list[float]]:
        if not texts:
            return []
        result = self.client.encode(self.model, list(texts), is_query=is_query, **self._options())
        return result.dense_rows().astype(float).tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._encode(texts, is_query=False)

    def embed_query(self, text: str) -> list[float]:
        return self._encode([text], is_query=True)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await self._aencode(texts, is_query=False)

    async def aembed_query(self, text: str) -> list[float]:
        return (await self._aencode([text], is_query=True))[0]

    def embed_image(self, uris: list[str]) -> list[list[float]]:
        """One vector per image file in `uris` (local paths), in order."""
        if not uris:
            return []
        result = self.client.encode(self.model, images=list(uris), **self._options())
        return result.dense_rows().astype(float).tolist()

    async def aembed_image(self, uris: list[str]) -> list[list[float]]:
        if not uris:
            return []
        async with AsyncClient(self.url, **self._client_options) as client:  # one per event loop
            result = await client.encode(self.model, images=list(uris), **self._options())
        return result.dense_rows().astype(float).tolist()

    async def _aencode(self, texts: Sequence[str], is_query: bool) -> list[list[float]]:
        if not texts:
            return []
        async with AsyncClient(self.url, **self._client_options) as client:  # one per event loop
            result = await client.encode(self.model, list(texts), is_query=is_query, **self._options())
        return result.dense_rows().astype(float).tolist()


class ShoalRerank(BaseDocumentCompressor):
    """Documents reordered by a shoal reranker (or any model that scores), best first; the score
    is kept in each document's `metadata["relevance_score"]`; `top_n` keeps the best n."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    url: str
    model: str
    top_n: int | None = None
    # A secret: kept out of repr() and of serialised objects.
    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
    _client: Client | None = PrivateAttr(default=None)

    def _ranked(self, documents: Sequence[Document], ranking) -> list[Document]:
        out = []
        for index, score in ranking:
            doc = documents[index]
            out.append(
                Document(page_content=doc.page_content, metadata={**doc.metadata, "relevance_score": score}, id=doc.id)
            )
        return out

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        if not documents:
            return []
        if self._client is None:
            self._client = Client(self.url, api_key=_secret(self.api_key))
        ranking = self._client.score(self.model, query, [d.page_content for d in documents], top_k=self.top_n)
        return self._ranked(documents, ranking)

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        if not documents:
            return []
        async with AsyncClient(self.url, api_key=_secret(self.api_key)) as client:
            ranking = await client.score(self.model, query, [d.page_content for d in documents], top_k=self.top_n)
        return self._ranked(documents, ranking)


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()
