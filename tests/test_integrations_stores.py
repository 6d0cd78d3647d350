"""Vector-store integrations end to end with the real libraries against a real server: Chroma's
in-memory client, a LanceDB table in a temporary folder and Qdrant's in-process `:memory:` mode each
index twelve Lee-corpus documents through shoal, and a sentence of document k finds document k."""

from __future__ import annotations

import uuid

import pytest

from conftest import MODEL_ID, query_of

SPLADE = "rasyosef/splade-tiny"
PROBES = (0, 5, 11)


# --- Chroma -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chroma():
    import chromadb

    return chromadb.EphemeralClient(chromadb.Settings(anonymized_telemetry=False))


def test_chroma_collection_with_shoal_embedding_function_retrieves_the_right_document(base_url, lee_documents, chroma):
    from shoal.integrations.chroma import ShoalEmbeddingFunction

    embed = ShoalEmbeddingFunction(url=base_url, model=MODEL_ID, batch_size=4)
    docs = chroma.create_collection(f"lee-{uuid.uuid4().hex[:8]}", embedding_function=embed)
    docs.add(ids=[str(i) for i in range(len(lee_documents))], documents=lee_documents)
    for i in PROBES:
        assert docs.query(query_texts=[query_of(lee_documents[i])], n_results=1)["ids"][0][0] == str(i)
    assert docs.configuration["hnsw"]["space"] == "cosine"  # the function's default space


def test_chroma_collection_reopened_without_a_function_rebuilds_shoal_from_its_config(base_url, lee_documents, chroma):
    from shoal.integrations.chroma import ShoalEmbeddingFunction

    name = f"lee-{uuid.uuid4().hex[:8]}"
    chroma.create_collection(name, embedding_function=ShoalEmbeddingFunction(url=base_url, model=MODEL_ID)).add(
        ids=[str(i) for i in range(len(lee_documents))], documents=lee_documents
    )
    reopened = chroma.get_collection(name)  # no embedding_function: chroma builds one from the saved config
    function = reopened.configuration["embedding_function"]
    assert isinstance(function, ShoalEmbeddingFunction) and function.get_config()["model"] == MODEL_ID
    assert reopened.query(query_texts=[query_of(lee_documents[7])], n_results=1)["ids"][0][0] == "7"


# --- LanceDB ------------------------------------------------------------------------------------


def test_lancedb_table_with_the_shoal_registry_entry_retrieves_the_right_document(base_url, lee_documents, tmp_path):
    import lancedb
    from lancedb.embeddings import get_registry
    from lancedb.pydantic import LanceModel, Vector

    import shoal.integrations.lancedb  # noqa: F401 (registers "shoal")

    embed = get_registry().get("shoal").create(url=base_url, model=MODEL_ID, batch_size=4)
    assert embed.ndims() == 384  # from the server's model entry

    class Doc(LanceModel):
        text: str = embed.SourceField()
        vector: Vector(embed.ndims()) = embed.VectorField()
        i: int

    table = lancedb.connect(tmp_path).create_table("lee", schema=Doc)
    table.add([{"text": text, "i": i} for i, text in enumerate(lee_documents)])
    for i in PROBES:
        assert table.search(query_of(lee_documents[i])).limit(1).to_pydantic(Doc)[0].i == i


# --- Qdrant -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid(base_url, lee_documents):
    from qdrant_client import QdrantClient

    from shoal.integrations.qdrant import ShoalHybrid

    index = ShoalHybrid(
        QdrantClient(":memory:"), "lee", url=base_url, dense_model=MODEL_ID, sparse_model=SPLADE, batch_size=5
    )  # three upserts of 5, 5 and 2
    index.create_collection()
    index.upsert(
        lee_documents, ids=list(range(len(lee_documents))), payloads=[{"i": i} for i in range(len(lee_documents))]
    )
    yield index
    index.close()


def test_qdrant_hybrid_query_fuses_dense_and_sparse_to_the_right_document(hybrid, lee_documents):
    for i in PROBES:
        points = hybrid.query(query_of(lee_documents[i]), limit=3)
        assert points[0].id == i and points[0].payload == {"i": i} and len(points) == 3


def test_qdrant_hybrid_collection_holds_both_vectors_and_each_alone_finds_the_document(hybrid, lee_documents):
    info = hybrid.qdrant.get_collection("lee")
    assert info.points_count == len(lee_documents) and info.config.params.vectors["dense"].size == 384
    vectors = hybrid.vectors([query_of(lee_documents[3])], is_query=True)[0]
    assert len(vectors["sparse"].indices) > 0 and max(vectors["sparse"].indices) < 30522  # SPLADE's vocabulary
    for name in ("dense", "sparse"):
        best = hybrid.qdrant.query_points("lee", query=vectors[name], using=name, limit=1).points[0]
        assert best.id == 3, name


def test_lancedb_never_stores_a_plain_api_key():
    from lancedb.embeddings import get_registry

    import shoal.integrations.lancedb  # noqa: F401  (registers "shoal")

    with pytest.raises(ValueError):
        get_registry().get("shoal").create(url="http://127.0.0.1:9", model=MODEL_ID, api_key="plain-secret-0123456789")
