"""Framework integrations end to end with the real libraries against a real server: index a handful
of Lee-corpus documents (gensim's wheel) and check a query retrieves the right one."""

from __future__ import annotations

from conftest import MODEL_ID, query_of


def test_langchain_vector_store_with_shoal_embeddings_retrieves_the_right_document(base_url, lee_documents):
    from langchain_core.vectorstores import InMemoryVectorStore

    from shoal.integrations.langchain import ShoalEmbeddings

    embeddings = ShoalEmbeddings(url=base_url, model=MODEL_ID, batch_size=4)
    store = InMemoryVectorStore.from_texts(
        lee_documents, embeddings, metadatas=[{"i": i} for i in range(len(lee_documents))]
    )
    for i in (0, 5, 11):
        assert store.similarity_search(query_of(lee_documents[i]), k=1)[0].metadata["i"] == i


def test_langchain_async_embeddings_equal_the_sync_ones(base_url, lee_documents):
    import asyncio

    import numpy as np

    from shoal.integrations.langchain import ShoalEmbeddings

    embeddings = ShoalEmbeddings(url=base_url, model=MODEL_ID)
    sync = np.array(embeddings.embed_documents(lee_documents[:3]))
    asynchronous = np.array(asyncio.run(embeddings.aembed_documents(lee_documents[:3])))
    assert np.abs(sync - asynchronous).max() <= 1e-6 and sync.shape == (3, 384)


def test_langchain_rerank_compressor_puts_the_right_document_first(base_url, lee_documents):
    from langchain_core.documents import Document

    from shoal.integrations.langchain import ShoalRerank

    documents = [Document(page_content=text, metadata={"i": i}) for i, text in enumerate(lee_documents)]
    rerank = ShoalRerank(url=base_url, model=MODEL_ID, top_n=3)
    ranked = rerank.compress_documents(documents, query_of(lee_documents[7]))
    assert len(ranked) == 3 and ranked[0].metadata["i"] == 7
    scores = [d.metadata["relevance_score"] for d in ranked]
    assert scores == sorted(scores, reverse=True)


def test_tokens_stay_out_of_the_adapters_reprs_and_serialised_forms(base_url):
    from shoal.integrations.langchain import ShoalRerank
    from shoal.integrations.llamaindex import ShoalEmbedding

    secret = "a-secret-token-0123456789"
    rerank = ShoalRerank(url=base_url, model=MODEL_ID, api_key=secret)
    embedding = ShoalEmbedding(url=base_url, model=MODEL_ID, api_key=secret)
    assert secret not in repr(rerank) and secret not in repr(embedding) and secret not in embedding.to_json()
