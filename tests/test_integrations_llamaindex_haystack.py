"""shoal.integrations.llamaindex and .haystack with the real libraries against a real server: index
Lee-corpus documents, check a query retrieves the right one and the reranker puts it first, and
that the vectors the adapters hand over are sentence-transformers' own, in order."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from conftest import MODEL_ID, query_of

# Haystack reports pipeline runs to PostHog unless told not to; read once, when haystack is imported.
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")

TARGETS = (0, 5, 11)


# --- LlamaIndex ----------------------------------------------------------------------------------


@pytest.fixture
def llamaindex_settings(monkeypatch, base_url):
    """LlamaIndex's globals for one test: shoal embeds, and a MockLLM stands in so nothing can call
    a real LLM (the default would be OpenAI)."""
    from llama_index.core import Settings
    from llama_index.core.llms import MockLLM

    from shoal.integrations.llamaindex import ShoalEmbedding

    embedding = ShoalEmbedding(url=base_url, model=MODEL_ID, embed_batch_size=4)
    monkeypatch.setattr(Settings, "_llm", MockLLM())
    monkeypatch.setattr(Settings, "_embed_model", embedding)
    return Settings


def lee_nodes(documents: list[str]):
    from llama_index.core.schema import TextNode

    # Nodes, not Documents: no splitter runs, so no tokenizer download and one node per document.
    return [TextNode(text=text, id_=f"lee-{i}") for i, text in enumerate(documents)]


def test_llamaindex_vector_store_index_with_shoal_embedding_retrieves_the_right_document(
    llamaindex_settings, lee_documents
):
    from llama_index.core import VectorStoreIndex

    index = VectorStoreIndex(lee_nodes(lee_documents))  # embeds with Settings.embed_model
    retriever = index.as_retriever(similarity_top_k=3)
    for i in TARGETS:
        assert retriever.retrieve(query_of(lee_documents[i]))[0].node.node_id == f"lee-{i}"


def test_llamaindex_embedding_batches_equal_sentence_transformers_in_order(base_url, lee_documents, embed_reference):
    from shoal.integrations.llamaindex import ShoalEmbedding

    embedding = ShoalEmbedding(url=base_url, model=MODEL_ID, embed_batch_size=5)  # 12 texts: 3 requests
    expected = embed_reference(lee_documents)
    sync = np.array(embedding.get_text_embedding_batch(lee_documents))
    asynchronous = np.array(asyncio.run(embedding.aget_text_embedding_batch(lee_documents)))
    query = np.array(asyncio.run(embedding.aget_query_embedding(lee_documents[3])))
    assert sync.shape == (12, 384)
    assert np.abs(sync - expected).max() <= 1e-5 and np.abs(asynchronous - expected).max() <= 1e-5
    assert np.abs(query - expected[3]).max() <= 1e-5  # MiniLM has no query prompt


def test_llamaindex_rerank_puts_the_right_node_first_and_keeps_top_n(base_url, lee_documents):
    from llama_index.core.schema import NodeWithScore

    from shoal.integrations.llamaindex import ShoalRerank

    # Retrieval order reversed, with scores that say the opposite of the truth.
    nodes = [NodeWithScore(node=node, score=float(i)) for i, node in enumerate(lee_nodes(lee_documents))][::-1]
    rerank = ShoalRerank(url=base_url, model=MODEL_ID, top_n=3)
    for i in TARGETS:
        query = query_of(lee_documents[i])
        ranked = rerank.postprocess_nodes(nodes, query_str=query)
        assert len(ranked) == 3 and ranked[0].node.node_id == f"lee-{i}"
        scores = [n.score for n in ranked]
        assert scores == sorted(scores, reverse=True) and scores[0] < 1.0 + 1e-6  # a cosine, not the input
        again = asyncio.run(rerank.apostprocess_nodes(nodes, query_str=query))
        assert [n.node.node_id for n in again] == [n.node.node_id for n in ranked]


# --- Haystack ------------------------------------------------------------------------------------


def haystack_documents(documents: list[str]):
    from haystack import Document

    return [Document(id=f"lee-{i}", content=text, meta={"i": i}) for i, text in enumerate(documents)]


def test_haystack_pipeline_with_shoal_embedders_and_ranker_retrieves_the_right_document(base_url, lee_documents):
    from haystack import Pipeline
    from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever
    from haystack.document_stores.in_memory import InMemoryDocumentStore

    from shoal.integrations.haystack import ShoalDocumentEmbedder, ShoalRanker, ShoalTextEmbedder

    store = InMemoryDocumentStore(embedding_similarity_function="cosine")
    indexing = Pipeline()
    indexing.add_component("embed", ShoalDocumentEmbedder(url=base_url, model=MODEL_ID, batch_size=4))
    indexing.add_component("write", _writer(store))
    indexing.connect("embed.documents", "write.documents")
    indexing.run({"embed": {"documents": haystack_documents(lee_documents)}})
    assert store.count_documents() == len(lee_documents)

    search = Pipeline()
    search.add_component("embed", ShoalTextEmbedder(url=base_url, model=MODEL_ID))
    search.add_component("retrieve", InMemoryEmbeddingRetriever(store, top_k=5))
    search.add_component("rank", ShoalRanker(url=base_url, model=MODEL_ID, top_k=2))
    search.connect("embed.embedding", "retrieve.query_embedding")
    search.connect("retrieve", "rank")
    for i in TARGETS:
        query = query_of(lee_documents[i])
        out = search.run({"embed": {"text": query}, "rank": {"query": query}}, include_outputs_from={"retrieve"})
        assert len(out["retrieve"]["documents"]) == 5 and out["retrieve"]["documents"][0].meta["i"] == i
        assert len(out["rank"]["documents"]) == 2 and out["rank"]["documents"][0].meta["i"] == i


def _writer(store):
    from haystack.components.writers import DocumentWriter

    return DocumentWriter(document_store=store)


def test_haystack_document_embedder_equals_sentence_transformers_in_order(base_url, lee_documents, embed_reference):
    from shoal.integrations.haystack import ShoalDocumentEmbedder, ShoalTextEmbedder

    expected = embed_reference(lee_documents)
    embedder = ShoalDocumentEmbedder(url=base_url, model=MODEL_ID, batch_size=5)  # 12 texts: 3 requests
    documents = embedder.run(haystack_documents(lee_documents))["documents"]
    assert [d.id for d in documents] == [f"lee-{i}" for i in range(12)]
    assert np.abs(np.array([d.embedding for d in documents]) - expected).max() <= 1e-5
    asynchronous = asyncio.run(embedder.run_async(haystack_documents(lee_documents)))["documents"]
    assert np.abs(np.array([d.embedding for d in asynchronous]) - expected).max() <= 1e-5
    query = ShoalTextEmbedder(url=base_url, model=MODEL_ID).run(lee_documents[3])["embedding"]
    assert np.abs(np.array(query) - expected[3]).max() <= 1e-5


def test_haystack_ranker_ranks_the_right_document_first_with_its_score(base_url, lee_documents):
    from haystack import Pipeline

    from shoal.integrations.haystack import ShoalRanker

    documents = haystack_documents(lee_documents)[::-1]
    ranker = ShoalRanker(url=base_url, model=MODEL_ID, top_k=5)
    for i in TARGETS:
        query = query_of(lee_documents[i])
        ranked = ranker.run(query=query, documents=documents, top_k=3)["documents"]
        assert len(ranked) == 3 and ranked[0].meta["i"] == i
        scores = [d.score for d in ranked]
        assert scores == sorted(scores, reverse=True)
        again = asyncio.run(ranker.run_async(query=query, documents=documents))["documents"]
        assert len(again) == 5 and [d.id for d in again[:3]] == [d.id for d in ranked]

    pipeline = Pipeline()  # and as a pipeline component, whose init parameters serialise
    pipeline.add_component("rank", ranker)
    assert pipeline.to_dict()["components"]["rank"]["init_parameters"]["model"] == MODEL_ID
    ranked = pipeline.run({"rank": {"query": query_of(lee_documents[5]), "documents": documents}})
    assert ranked["rank"]["documents"][0].meta["i"] == 5
