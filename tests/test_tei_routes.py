"""TEI-compatible routes over real HTTP: `huggingface_hub`'s `InferenceClient` (`feature_extraction`,
`sentence_similarity`) pointed at a shoal server, and TEI's `/embed`, `/embed_sparse`, `/similarity`,
`/`, `/info`, `/health` as TEI's router defines them; vectors against sentence-transformers."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from huggingface_hub import InferenceClient

from conftest import MODEL_ID

SPLADE = "rasyosef/splade-tiny"
TEXTS = ["The cat sat on the mat.", "A dog slept in the sun.", "Stocks fell sharply on Monday."]


@pytest.fixture
def hf(base_url, monkeypatch) -> InferenceClient:
    """The client as a user runs it. The suite sets HF_HUB_OFFLINE=1 (no Hub), which the client
    also applies to any URL: lifted here, for this loopback server only."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    return InferenceClient(model=base_url, timeout=60)


def test_feature_extraction_of_huggingface_hub_equals_sentence_transformers(hf, embed_reference):
    got = hf.feature_extraction(TEXTS[0])
    assert got.shape == (1, 384)
    assert np.abs(got[0] - embed_reference([TEXTS[0]])[0]).max() <= 1e-5


def test_sentence_similarity_of_huggingface_hub_is_the_cosine_of_the_reference_vectors(hf, embed_reference):
    scores = hf.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    vectors = embed_reference(TEXTS)
    assert np.abs(np.array(scores) - vectors[1:] @ vectors[0]).max() <= 1e-5


def test_embed_takes_a_batch_normalize_and_dimensions_as_tei_does(base_url, embed_reference):
    reference = embed_reference(TEXTS)
    batch = httpx.post(f"{base_url}/embed", json={"inputs": TEXTS}, timeout=60).json()
    assert np.abs(np.array(batch) - reference).max() <= 1e-5
    raw = np.array(httpx.post(f"{base_url}/embed", json={"inputs": TEXTS[0], "normalize": False}).json()[0])
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3  # not normalised
    assert np.abs(raw / np.linalg.norm(raw) - reference[0]).max() <= 1e-5
    short = np.array(httpx.post(f"{base_url}/embed", json={"inputs": TEXTS[0], "dimensions": 128}).json()[0])
    cut = reference[0][:128] / np.linalg.norm(reference[0][:128])
    assert short.shape == (128,) and np.abs(short - cut).max() <= 1e-5


def test_post_root_serves_embed_similarity_or_rerank_by_its_body(base_url, embed_reference):
    vectors = embed_reference(TEXTS)
    embedded = httpx.post(f"{base_url}/", json={"inputs": TEXTS[:2]}).json()
    assert np.abs(np.array(embedded) - vectors[:2]).max() <= 1e-5
    similar = httpx.post(
        f"{base_url}/", json={"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}, "parameters": {}}
    ).json()
    assert np.abs(np.array(similar) - vectors[1:] @ vectors[0]).max() <= 1e-5
    ranked = httpx.post(f"{base_url}/", json={"query": TEXTS[0], "texts": TEXTS[1:]}).json()
    assert ranked == httpx.post(f"{base_url}/rerank", json={"query": TEXTS[0], "texts": TEXTS[1:]}).json()


def test_embed_sparse_equals_the_native_sparse_output_of_the_same_model(base_url):
    tei = httpx.post(f"{base_url}/embed_sparse?model={SPLADE}", json={"inputs": TEXTS[:2]}, timeout=120).json()
    native = httpx.post(
        f"{base_url}/v1/encode",
        json={"model": SPLADE, "items": [{"text": t} for t in TEXTS[:2]], "options": {"outputs": ["sparse"]}},
        timeout=120,
    ).json()
    for values, item in zip(tei, native["items"]):
        assert [v["index"] for v in values] == item["sparse"]["indices"]
        assert np.allclose([v["value"] for v in values], item["sparse"]["values"], atol=1e-6)
        assert len(values) > 0


def test_the_model_is_picked_by_query_or_header_and_info_describes_it(base_url):
    info = httpx.get(f"{base_url}/info").json()
    assert info["model_id"] == MODEL_ID and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] > 0
    sparse_info = httpx.get(f"{base_url}/info", params={"model": SPLADE}).json()
    assert sparse_info["model_id"] == SPLADE and sparse_info["model_type"] == {"embedding": {"pooling": "splade"}}
    by_header = httpx.post(
        f"{base_url}/embed_sparse", json={"inputs": "cat"}, headers={"x-shoal-model": SPLADE}, timeout=120
    )
    assert by_header.status_code == 200 and by_header.json()[0]
    assert httpx.get(f"{base_url}/health").status_code == 200 and httpx.get(f"{base_url}/").status_code == 200


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/embed", {"inputs": "x", "truncation_direction": "Left"}, 400, "truncates on the right only"),
        ("/embed", {"inputs": []}, 400, "inputs"),
        ("/embed", {"inputs": [1, 2, 3]}, 400, "inputs"),
        ("/embed", {"inputs": "word " * 2000}, 422, "truncate"),
        ("/similarity", {"inputs": {"source_sentence": "x", "sentences": []}}, 400, "sentences"),
        ("/embed_sparse", {"inputs": "x"}, 400, "sparse"),
    ],
)
def test_bad_tei_requests_get_a_4xx_that_says_what_to_fix(base_url, path, body, status, words):
    response = httpx.post(f"{base_url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_embed_all_is_every_tokens_last_hidden_state_as_transformers_computes_it(base_url, model_dir):
    import torch
    import transformers

    states = httpx.post(f"{base_url}/embed_all", json={"inputs": TEXTS[:2]}, timeout=60).json()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    for text, got in zip(TEXTS[:2], states):
        with torch.no_grad():
            expected = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].numpy()
        assert np.array(got).shape == expected.shape
        assert np.abs(np.array(got) - expected).max() <= 1e-4


def test_tokenize_gives_ids_texts_and_offsets_as_the_models_tokenizer(base_url, model_dir):
    import transformers

    text = "Tokenize this, please: naïve café!"
    got = httpx.post(f"{base_url}/tokenize", json={"inputs": [text]}).json()[0]
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)(
        text, return_offsets_mapping=True, return_special_tokens_mask=True
    )
    assert [t["id"] for t in got] == reference["input_ids"]
    for token, (start, stop), special in zip(got, reference["offset_mapping"], reference["special_tokens_mask"]):
        assert token["special"] == bool(special)
        if special:
            assert token["start"] is None and token["text"] in ("[CLS]", "[SEP]")
        else:
            assert (token["start"], token["stop"]) == (start, stop) and token["text"] == text[start:stop]
    bare = httpx.post(f"{base_url}/tokenize", json={"inputs": text, "add_special_tokens": False}).json()[0]
    assert [t["id"] for t in bare] == reference["input_ids"][1:-1]


def test_llama_index_tei_embedder_and_chroma_hf_embedding_server_equal_the_reference(base_url, embed_reference):
    from chromadb.utils.embedding_functions import HuggingFaceEmbeddingServer
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    reference = embed_reference(TEXTS)
    llama = TextEmbeddingsInference(model_name=MODEL_ID, base_url=base_url, timeout=60)  # model_name: informative
    got = np.array(llama.get_text_embedding_batch(TEXTS))
    assert np.abs(got - reference).max() <= 1e-5
    assert np.abs(np.array(llama.get_query_embedding(TEXTS[0])) - reference[0]).max() <= 1e-5
    chroma = HuggingFaceEmbeddingServer(url=f"{base_url}/embed")
    assert np.abs(np.array(chroma(TEXTS)) - reference).max() <= 1e-5


def test_info_with_an_unknown_task_and_a_deeply_nested_root_body_are_400s(base_url):
    bogus = httpx.get(f"{base_url}/info", params={"task": "bogus"})
    assert bogus.status_code == 400 and "encode, score, extract" in bogus.json()["error"]["message"]
    nested = httpx.post(
        f"{base_url}/", content=b"[" * 100_000 + b"]" * 100_000, headers={"content-type": "application/json"}
    )
    assert nested.status_code == 400, nested.text


def test_the_default_model_of_a_sparse_route_is_one_with_sparse_output(base_url):
    response = httpx.post(f"{base_url}/embed_sparse", json={"inputs": "cat"})  # only a dense model is preloaded
    assert response.status_code == 400
    assert "no default or preloaded model encodes sparse vectors" in response.json()["error"]["message"]


# --- which model answers a model-less route ---------------------------------------------------------


@pytest.fixture(scope="module")
def two_encoders(serve, tmp_path_factory) -> str:
    """A server with two dense encoders preloaded and no default: MiniLM, and MiniLM's weights
    under a second id (a card of its own, 128 tokens)."""
    from test_fleet import write_card

    cards = tmp_path_factory.mktemp("two-encoders")
    write_card(cards, "test/second-encoder")
    return serve(preload=(MODEL_ID, "test/second-encoder"), cards_dirs=(cards,))


@pytest.mark.parametrize("path, body", [("/embed", {"inputs": "cat"}), ("/", {"inputs": "cat"})])
def test_a_model_less_request_with_two_encoders_preloaded_and_no_default_is_a_400_naming_them(two_encoders, path, body):
    response = httpx.post(f"{two_encoders}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["details"]["candidates"] == [MODEL_ID, "test/second-encoder"]
    assert "X-Shoal-Model" in error["message"] and "--default-model" in error["message"]
    picked = httpx.post(f"{two_encoders}{path}", json=body, headers={"x-shoal-model": "test/second-encoder"})
    assert picked.status_code == 200 and picked.headers["x-shoal-model"] == "test/second-encoder"


def test_every_answer_names_the_model_that_served_it(base_url, two_encoders):
    tei = httpx.post(f"{base_url}/embed", json={"inputs": "cat"}, timeout=60)  # one encoder: it answers
    assert tei.status_code == 200 and tei.headers["x-shoal-model"] == MODEL_ID
    native = httpx.post(f"{base_url}/v1/encode", json={"model": MODEL_ID, "items": [{"text": "cat"}]}, timeout=60)
    assert native.headers["x-shoal-model"] == MODEL_ID and "x-shoal-adapter" not in native.headers
    openai = httpx.post(
        f"{two_encoders}/v1/embeddings", json={"model": "test/second-encoder", "input": "cat"}, timeout=60
    )
    assert openai.status_code == 200 and openai.headers["x-shoal-model"] == "test/second-encoder"
    refused = httpx.post(f"{two_encoders}/embed", json={"inputs": "cat"}, timeout=60)
    assert "x-shoal-model" not in refused.headers  # no model answered
