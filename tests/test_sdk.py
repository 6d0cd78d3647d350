"""`shoal.sdk` against real servers and through a mock transport.

Real servers: the MiniLM server of conftest (vectors equal sentence-transformers', computed here;
scores equal the cosine of those vectors), a token classifier (entities equal transformers'
pipeline), and, torch-free (`light`), a server over `standin.StandIn`. The retry, deadline and
chunking rules are pinned with `httpx.MockTransport`, which counts every request it answers.
Nothing heavy is imported at module level: the `light` tests also run in CI's torch-free venv.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from conftest import MODEL_ID, running_server
from shoal.errors import (
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    ShoalError,
    Unauthorized,
    UnknownModel,
)
from shoal.sdk import AsyncClient, Client, Entity, Scored
from shoal.wire import array_to_msgpack
from standin import RERANK_MODEL, StandIn

BASE = "http://shoal.test"
DENSE = "standin/dense-16"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on stage.",
    "¿Dónde está la biblioteca?",
    "naïve café résumé — unicode survives the wire",
    "x",
]
QUERY = "a musician performs with a guitar"


def lee_sentences(count: int) -> list[str]:
    """The first `count` sentences of the Lee background corpus that gensim's wheel ships."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs gensim's Lee corpus")
    path = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data" / "lee_background.cor"
    text = path.read_text(encoding="utf-8", errors="replace")
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 20]
    return sentences[:count]


# --- the MiniLM server (real engine, real weights) --------------------------------------------------


@pytest.mark.parametrize("format", ["msgpack", "json"])
def test_sync_encode_equals_sentence_transformers(base_url, embed_reference, format):
    with Client(base_url, format=format) as client:
        out = client.encode(MODEL_ID, TEXTS)
    expected = embed_reference(TEXTS)
    assert out.dense.shape == (len(TEXTS), 384) and out.dense.dtype == np.float32
    assert np.abs(out.dense - expected).max() <= 1e-5
    assert out.sparse is None and out.multivector is None
    assert out.model == MODEL_ID and out.num_tokens > len(TEXTS)


@pytest.mark.parametrize("format", ["msgpack", "json"])
def test_async_encode_equals_sentence_transformers_with_dimensions_and_float16(base_url, embed_reference, format):
    async def main():
        async with AsyncClient(base_url, format=format) as client:
            return await asyncio.gather(
                client.encode(MODEL_ID, TEXTS), client.encode(MODEL_ID, TEXTS, dimensions=64, output_dtype="float16")
            )

    full, cut = asyncio.run(main())
    expected = embed_reference(TEXTS)
    assert np.abs(full.dense - expected).max() <= 1e-5
    head = expected[:, :64] / np.linalg.norm(expected[:, :64], axis=1, keepdims=True)  # truncate, then normalise
    assert cut.dense.dtype == np.float16 and cut.dense.shape == (len(TEXTS), 64)
    assert np.abs(cut.dense.astype(np.float32) - head).max() <= 1e-3  # float16's resolution


class CountingTransport(httpx.AsyncBaseTransport):
    """The real network transport, counting requests and the most in flight at once."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.sizes: list[int] = []
        self.in_flight = self.max_in_flight = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sizes.append(len(msgspec.msgpack.decode(request.content)["items"]))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.inner.handle_async_request(request)
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_bulk_encode_of_300_lee_sentences_keeps_order_in_chunks_of_32_four_at_a_time(base_url, embed_reference):
    sentences = lee_sentences(300)
    assert len(sentences) == 300
    transport = CountingTransport()

    async def main():
        async with AsyncClient(base_url, transport=transport) as client:
            return await client.encode(MODEL_ID, sentences, batch_size=32, concurrency=4, show_progress=True)

    out = asyncio.run(main())
    expected = embed_reference(sentences)
    assert out.dense.shape == (300, 384)
    assert np.abs(out.dense - expected).max(axis=1).max() <= 1e-5  # row by row: order kept
    assert sorted(transport.sizes) == sorted([32] * 9 + [12])  # the server takes at most 64 per request
    assert transport.max_in_flight == 4


def test_score_with_minilm_is_the_cosine_of_the_reference_vectors_best_first(base_url, embed_reference):
    with Client(base_url) as client:
        ranking = client.score(MODEL_ID, QUERY, TEXTS)
        top = client.score(MODEL_ID, QUERY, TEXTS, top_k=2)
    vectors = embed_reference([QUERY, *TEXTS])
    cosines = vectors[1:] @ vectors[0] / (np.linalg.norm(vectors[1:], axis=1) * np.linalg.norm(vectors[0]))
    order = sorted(range(len(TEXTS)), key=lambda i: -cosines[i])
    assert [index for index, _ in ranking] == order and order[0] == 1  # the guitar sentence wins
    assert max(abs(score - cosines[index]) for index, score in ranking) <= 1e-5
    assert top == ranking[:2] and all(isinstance(s, Scored) for s in top)
    assert ranking.model == MODEL_ID and ranking.truncated == frozenset() and ranking.num_tokens > 0


def test_models_lists_minilm_and_model_fetches_its_entry_by_an_id_with_a_slash(base_url):
    with Client(base_url) as client:
        listed = {m["id"]: m for m in client.models()}
        entry = client.model(MODEL_ID)
        with pytest.raises(UnknownModel, match="no/such-model"):
            client.model("no/such-model")
    assert listed[MODEL_ID]["dimensions"] == 384 and listed[MODEL_ID]["loaded"] is True
    assert entry["id"] == MODEL_ID and "encode" in entry["tasks"]


@pytest.mark.parametrize("format", ["msgpack", "json"])
def test_server_errors_raise_as_their_own_class_at_once(base_url, format):
    with Client(base_url, format=format) as client:
        with pytest.raises(UnknownModel) as unknown:
            client.encode("no/such-model", ["x"])
        with pytest.raises(InvalidRequest, match="dimensions") as invalid:
            client.encode(MODEL_ID, ["x"], dimensions=10_000)
        with pytest.raises(InvalidRequest, match="items"):
            client.encode(MODEL_ID, [])
    assert unknown.value.code == "unknown_model" and not isinstance(invalid.value, UnknownModel)


# --- a token classifier (real engine, random weights) -----------------------------------------------


@pytest.fixture(scope="module")
def tagger(tmp_path_factory, serve):
    """(server URL, transformers' token-classification pipeline) for one random BERT tagger."""
    import transformers

    from extract_models import extract_card
    from test_token_class import BIO, save_token_classifier

    directory = tmp_path_factory.mktemp("sdk-tagger")
    save_token_classifier(directory, BIO)
    cards = tmp_path_factory.mktemp("sdk-cards")
    (cards / "tagger.yaml").write_text(extract_card(directory, "test/sdk-tagger", "token_class", max_length=128))
    pipe = transformers.pipeline(
        "token-classification", model=str(directory), aggregation_strategy="simple", device="cpu"
    )
    return serve(preload=("test/sdk-tagger",), cards_dirs=(cards,)), pipe


def test_extract_entities_equal_transformers_pipeline_across_chunks(tagger):
    url, pipe = tagger
    texts = ["Angela Merkel met Emmanuel Macron in Paris, France, on Tuesday.", *TEXTS]
    with Client(url) as client:
        items = client.extract("test/sdk-tagger", texts, aggregation="simple", batch_size=2)
    assert len(items) == len(texts)
    found = 0
    for text, item in zip(texts, items):
        expected = pipe(text)
        assert [(e.label, e.start, e.end) for e in item.entities] == [
            (e["entity_group"], e["start"], e["end"]) for e in expected
        ], text
        assert all(isinstance(e, Entity) and e.text == text[e.start : e.end] for e in item.entities)
        assert (
            max((abs(e.score - float(x["score"])) for e, x in zip(item.entities, expected, strict=True)), default=0)
            <= 1e-4
        )
        found += len(expected)
    assert found > 0  # not a comparison of empty lists


# --- a torch-free server over the stand-in (light) --------------------------------------------------


@pytest.fixture(scope="module")
def standin_url():
    from shoal.api import create_app
    from shoal.config import Settings

    with running_server(create_app(Settings(allow_download=False), StandIn(), preload=(DENSE, RERANK_MODEL))) as url:
        yield url


@pytest.mark.light
@pytest.mark.parametrize("format", ["msgpack", "json"])
def test_the_sdk_encodes_and_scores_against_a_torch_free_server(standin_url, format):
    docs = ["the dog sat on a rug", "a cat sat on the mat", "fish swim in the sea"]
    with Client(standin_url, format=format) as client:
        out = client.encode(DENSE, TEXTS, dimensions=8, batch_size=2)
        ranking = client.score(RERANK_MODEL, "cat sat on mat", docs)
    assert out.dense.tolist() == [StandIn.vector(DENSE, t, dimensions=8).tolist() for t in TEXTS]
    scored = sorted(
        (StandIn.score("cat sat on mat", d, index=i)[0] for i, d in enumerate(docs)), key=lambda s: (-s.score, s.index)
    )
    assert ranking == [(s.index, s.score) for s in scored] and ranking[0].index == 1


@pytest.mark.light
def test_importing_the_sdk_needs_no_torch_tokenizers_or_engine():
    from test_light_install import run_child

    assert run_child("import", "shoal.sdk", "--block") == {"errors": {}, "blocked_loaded": []}
    # Where they are installed, importing the SDK still loads none of them, nor tqdm (show_progress only).
    code = (
        "import sys, shoal.sdk; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'tokenizers', 'transformers', 'tqdm') or m.startswith('shoal.engine')))"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- retries, deadlines and chunks through a mock transport (light) ---------------------------------


def vector(text: str) -> np.ndarray:
    """The mock server's `[4]` float32 vector of a text: different for every text."""
    return np.array([len(text), ord(text[0]), ord(text[-1]), sum(map(ord, text)) % 97], dtype=np.float32)


def encoded(request: httpx.Request) -> httpx.Response:
    body = msgspec.msgpack.decode(request.content)
    items = [{"id": None, "dense": array_to_msgpack(vector(item["text"]))} for item in body["items"]]
    answer = {
        "model": body["model"],
        "items": items,
        "usage": {"tokens": 3 * len(items)},
        "timings": {"tokenize_ms": 0.0, "queue_ms": 0.0, "inference_ms": 0.0, "total_ms": 0.0},
    }
    return httpx.Response(200, content=msgspec.msgpack.encode(answer), headers={"content-type": "application/msgpack"})


def failed(
    status: int, code: str, message: str = "no", retry_after: str | None = None, details: dict | None = None
) -> httpx.Response:
    headers = {} if retry_after is None else {"retry-after": retry_after}
    return httpx.Response(
        status, json={"error": {"code": code, "message": message, "details": details or {}}}, headers=headers
    )


class Mock:
    """A MockTransport whose `answers` (responses or exceptions) are served in turn, the last one
    for every request after; `requests` records each request as sent."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []
        self.transport = httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer(request) if callable(answer) else answer

    def bodies(self) -> list[dict]:
        return [msgspec.msgpack.decode(r.content) for r in self.requests]


def encode_with(mock: Mock, texts=("a", "b"), **client_options):
    async def main():
        async with AsyncClient(BASE, transport=mock.transport, **client_options) as client:
            return await client.encode("m", list(texts))

    return asyncio.run(main())


@pytest.mark.light
def test_a_503_with_retry_after_0_twice_then_200_succeeds_on_the_third_request():
    mock = Mock(failed(503, "overloaded", retry_after="0"), failed(503, "overloaded", retry_after="0"), encoded)
    out = encode_with(mock)
    assert len(mock.requests) == 3
    assert out.dense.tolist() == [vector("a").tolist(), vector("b").tolist()] and out.num_tokens == 6


@pytest.mark.light
def test_a_connection_error_is_retried_and_a_read_timeout_is_not():
    mock = Mock(httpx.ConnectError("refused"), encoded)
    assert encode_with(mock).dense.shape == (2, 4) and len(mock.requests) == 2
    mock = Mock(httpx.ReadTimeout("slow"), encoded)
    with pytest.raises(httpx.ReadTimeout):
        encode_with(mock)
    assert len(mock.requests) == 1


@pytest.mark.light
def test_retries_stop_after_max_retries_with_the_servers_error():
    mock = Mock(failed(503, "overloaded", "queue full", retry_after="0"))
    with pytest.raises(Overloaded, match="queue full") as raised:
        encode_with(mock, max_retries=2)
    assert len(mock.requests) == 3 and isinstance(raised.value.retry_after_s, float)


@pytest.mark.light
def test_a_retry_after_beyond_the_deadline_raises_overloaded_at_once():
    mock = Mock(failed(503, "overloaded", retry_after="30"), encoded)
    started = time.monotonic()
    with pytest.raises(Overloaded) as raised:
        encode_with(mock, deadline_s=5.0)
    assert time.monotonic() - started < 1.0 and len(mock.requests) == 1 and raised.value.retry_after_s == 30.0


@pytest.mark.light
def test_back_off_stops_at_the_deadline_and_each_request_carries_what_is_left_of_it():
    mock = Mock(failed(503, "overloaded", retry_after="0"))
    started = time.monotonic()
    with pytest.raises(Overloaded):
        encode_with(mock, deadline_s=0.6, max_retries=100)
    assert time.monotonic() - started <= 0.7
    budgets = [body["options"]["timeout_s"] for body in mock.bodies()]
    assert len(budgets) >= 2 and all(0 < b <= 0.6 for b in budgets)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] - budgets[-1] >= 0.1  # waits in between


@pytest.mark.light
def test_a_request_still_in_flight_at_the_deadline_raises_deadline_exceeded():
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(10)
        return encoded(request)

    async def main():
        async with AsyncClient(BASE, transport=httpx.MockTransport(slow), deadline_s=0.3) as client:
            return await client.encode("m", ["a"])

    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        asyncio.run(main())
    assert time.monotonic() - started < 1.0


@pytest.mark.light
@pytest.mark.parametrize(
    "status,code,error",
    [
        (400, "invalid_request", InvalidRequest),
        (404, "unknown_model", UnknownModel),
        (401, "unauthorized", Unauthorized),
        (502, "model_load_failed", ShoalError),  # no Retry-After: the server will not try again soon
    ],
)
def test_an_error_that_retrying_cannot_fix_raises_its_class_after_one_request(status, code, error):
    mock = Mock(failed(status, code, "bad dimensions", details={"option": "dimensions"}), encoded)
    with pytest.raises(error, match="bad dimensions") as raised:
        encode_with(mock)
    assert len(mock.requests) == 1
    assert raised.value.code == code and raised.value.details == {"option": "dimensions"}


@pytest.mark.light
def test_a_502_with_retry_after_is_retried():
    mock = Mock(failed(502, "model_load_failed", retry_after="0"), encoded)
    assert encode_with(mock).dense.shape == (2, 4) and len(mock.requests) == 2


@pytest.mark.light
def test_a_body_that_is_not_shoals_error_shape_still_raises_a_shoal_error():
    mock = Mock(httpx.Response(400, text="<html>bad gateway</html>", headers={"content-type": "text/html"}))
    with pytest.raises(InvalidRequest, match="HTTP 400: <html>bad gateway"):
        encode_with(mock)


@pytest.mark.light
def test_bulk_retries_only_the_chunk_that_failed_and_keeps_the_order():
    texts = [f"t{i}" for i in range(10)]
    sent: dict[str, int] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        first = msgspec.msgpack.decode(request.content)["items"][0]["text"]
        sent[first] = sent.get(first, 0) + 1
        if first == "t3" and sent[first] == 1:
            return failed(503, "overloaded", retry_after="0")
        return encoded(request)

    async def main():
        async with AsyncClient(BASE, transport=httpx.MockTransport(handle)) as client:
            return await client.encode("m", texts, batch_size=3, concurrency=2)

    out = asyncio.run(main())
    assert sent == {"t0": 1, "t3": 2, "t6": 1, "t9": 1}
    assert out.dense.tolist() == [vector(t).tolist() for t in texts]


@pytest.mark.light
def test_a_chunk_that_keeps_failing_fails_the_bulk_call():
    def handle(request: httpx.Request) -> httpx.Response:
        first = msgspec.msgpack.decode(request.content)["items"][0]["text"]
        return failed(400, "invalid_request", "chunk refused") if first == "t2" else encoded(request)

    async def main():
        async with AsyncClient(BASE, transport=httpx.MockTransport(handle)) as client:
            return await client.encode("m", [f"t{i}" for i in range(6)], batch_size=2)

    with pytest.raises(InvalidRequest, match="chunk refused"):
        asyncio.run(main())


@pytest.mark.light
def test_encode_sends_the_options_adapter_and_bearer_token_as_the_wire_defines_them():
    mock = Mock(encoded)
    encode_with(mock, api_key="sk-1", headers={"x-request-id": "r1"})
    with Client(BASE, transport=mock.transport) as client:
        client.encode(
            "m",
            ["a"],
            adapter="legal",
            normalize=False,
            dimensions=2,
            is_query=True,
            prompt_name="q",
            truncate=False,
            outputs=["dense", "sparse"],
            sparse_top_k=5,
        )
    first, second = mock.requests
    assert first.headers["authorization"] == "Bearer sk-1" and first.headers["x-request-id"] == "r1"
    assert first.headers["content-type"] == first.headers["accept"] == "application/msgpack"
    assert "authorization" not in second.headers
    body = mock.bodies()[1]
    assert body["model"] == "m" and body["adapter"] == "legal" and body["items"] == [{"text": "a", "id": None}]
    options = {k: v for k, v in body["options"].items() if v is not None}
    assert options == {
        "normalize": False,
        "dimensions": 2,
        "output_dtype": "float32",
        "is_query": True,
        "prompt_name": "q",
        "truncate": False,
        "outputs": ["dense", "sparse"],
        "sparse_top_k": 5,
        "return_tokens": False,
    }


@pytest.mark.light
def test_json_format_posts_json_and_reads_json_lists_back_in_the_asked_dtype():
    def handle(request: httpx.Request) -> httpx.Response:
        body = msgspec.json.decode(request.content)
        items = [
            {"id": None, "dense": [1, -2, 3], "sparse": {"indices": [7, 2], "values": [0.5, 0.25]}}
            for _ in body["items"]
        ]
        return httpx.Response(
            200,
            json={
                "model": "m",
                "items": items,
                "usage": {"tokens": 1},
                "timings": {"tokenize_ms": 0, "queue_ms": 0, "inference_ms": 0, "total_ms": 0},
            },
        )

    mock = Mock(handle)
    with Client(BASE, transport=mock.transport, format="json") as client:
        out = client.encode("m", ["a", "b"], output_dtype="int8")
    assert mock.requests[0].headers["content-type"] == "application/json"
    assert out.dense.dtype == np.int8 and out.dense.tolist() == [[1, -2, 3]] * 2
    indices, values = out.sparse[1]
    assert indices.dtype == np.int32 and indices.tolist() == [7, 2] and values.tolist() == [0.5, 0.25]


@pytest.mark.light
def test_score_and_extract_requests_and_answers():
    def handle(request: httpx.Request) -> httpx.Response:
        body = msgspec.msgpack.decode(request.content)
        if request.url.path == "/v1/score":
            items = [{"id": None, "index": 2, "score": 0.9}, {"id": None, "index": 0, "score": 0.1, "truncated": True}]
        else:
            items = [
                {
                    "id": None,
                    "index": i,
                    "entities": [{"text": t[:2], "label": body["labels"][0], "score": 0.7, "start": 0, "end": 2}],
                }
                for i, t in enumerate(item["text"] for item in body["items"])
            ]
        answer = {
            "model": body["model"],
            "items": items,
            "usage": {"tokens": 4},
            "timings": {"tokenize_ms": 0.0, "queue_ms": 0.0, "inference_ms": 0.0, "total_ms": 0.0},
        }
        return httpx.Response(
            200, content=msgspec.msgpack.encode(answer), headers={"content-type": "application/msgpack"}
        )

    mock = Mock(handle)
    with Client(BASE, transport=mock.transport) as client:
        ranking = client.score("r", "q", ["d0", "d1", "d2"], top_k=2, raw_scores=True, max_tokens_per_doc=8)
        items = client.extract("g", ["Ann met Bob", "Cy", "Di"], ["person"], threshold=0.4, batch_size=2)
    score_body, *extract_bodies = mock.bodies()
    assert score_body["query"] == "q" and [i["text"] for i in score_body["items"]] == ["d0", "d1", "d2"]
    assert score_body["top_k"] == 2 and score_body["options"]["raw_scores"] is True
    assert score_body["options"]["max_tokens_per_doc"] == 8
    assert ranking == [(2, 0.9), (0, 0.1)] and ranking.truncated == frozenset({0}) and ranking.num_tokens == 4
    assert [[i["text"] for i in b["items"]] for b in extract_bodies] == [["Ann met Bob", "Cy"], ["Di"]]
    assert all(b["labels"] == ["person"] and b["options"]["threshold"] == 0.4 for b in extract_bodies)
    assert [item.entities for item in items] == [[Entity(t, "person", 0.7, 0, 2)] for t in ("An", "Cy", "Di")]


@pytest.mark.light
def test_a_single_string_is_refused_and_a_closed_client_refuses_calls():
    client = Client(BASE, transport=Mock(encoded).transport)
    with pytest.raises(TypeError, match="not one str"):
        client.encode("m", "hello")
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.encode("m", ["hello"])
