"""The cluster as users run it: a real nats-server, `shoal gateway` and two `shoal worker` processes
on loopback, real models, real HTTP.

One module-scoped cluster serves every test, in file order: parity with `shoal serve` first, then
the tests that kill, stop and restart its parts (each restores what it broke).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from conftest import MODEL_ID, live_objects, metric_total, query_of
from extract_models import build_token_classifier, extract_card
from rerankers import build_minilm_reranker, reranker_card
from shoal.bench.workloads import GLIREL_TYPES, glirel_schema
from shoal.calls import ExtractCall
from shoal.catalog import Catalog
from shoal.cluster import protocol as p
from shoal.cluster.cli import free_port, start_nats, wait_for_port
from shoal.verbs import KINDS, estimate_tokens
from test_cluster_images import published

pytestmark = pytest.mark.timeout(300)

RERANKER = "test/minilm-reranker"
TAGGER = "test/tagger"
CLASSIFIER = "test/minilm-classifier"
GLIREL = "test/glirel"  # tests/test_glirel.py's random GLiREL, where the glirel package is installed
UNSERVED = "BAAI/bge-small-en-v1.5"  # in the gateway's catalog, served by no worker
ACK_WAIT_S = 3.0


class Cluster:
    """nats-server, one gateway and two workers as subprocesses; each part can be killed and restarted."""

    def __init__(self, root: Path, cards: Path) -> None:
        self.root, self.cards = root, cards
        self.nats_port, self.gateway_port = free_port(), free_port()
        self.store = root / "jetstream"
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.metrics_ports = [free_port(), free_port()]
        self.workers: list[subprocess.Popen | None] = [None, None]
        self.nats = self.gateway = None
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def _log(self, name: str):
        return open(self.root / f"{name}.log", "ab")

    def start_nats(self) -> None:
        self.nats = start_nats(self.nats_port, self.store, log_file=self._log("nats"))

    def start_gateway(self, extra_env: dict | None = None, port: int | None = None) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "shoal.cli",
            "gateway",
            "--nats-url",
            self.nats_url,
            "--port",
            str(port or self.gateway_port),
            "--models-dir",
            str(self.cards),
            "--models",
            f"{MODEL_ID},test/*,{UNSERVED}",
            "--log-level",
            "warning",
        ]
        process = subprocess.Popen(
            cmd, env={**self.env, **(extra_env or {})}, stdout=self._log("gateway"), stderr=subprocess.STDOUT
        )
        wait_for_port(port or self.gateway_port, 60, process)
        if port is None:
            self.gateway = process
        return process

    def start_worker(self, index: int) -> None:
        cmd = [
            sys.executable,
            "-m",
            "shoal.cli",
            "worker",
            "--nats-url",
            self.nats_url,
            "--models-dir",
            str(self.cards),
            "--models",
            f"{MODEL_ID},test/*",
            "--preload",
            MODEL_ID,
            "--preload",
            RERANKER,
            "--preload",
            TAGGER,
            "--metrics-port",
            str(self.metrics_ports[index]),
            "--ack-wait-s",
            str(ACK_WAIT_S),
            "--log-level",
            "warning",
        ]
        self.workers[index] = subprocess.Popen(
            cmd, env=self.env, stdout=self._log(f"worker{index}"), stderr=subprocess.STDOUT
        )

    def wait_for_workers(self, count: int = 2, timeout_s: float = 180) -> None:
        """Until every running worker is ready (its preloads loaded, pulling) and the gateway counts
        `count` live workers on two reads of its gauge a refresh apart. A worker killed a moment ago
        still counts until worker_ttl_s has passed, so the gauge alone could count a dead worker in
        place of a restarted one that is still loading."""
        deadline = time.monotonic() + timeout_s
        seen_at: float | None = None
        while time.monotonic() < deadline:
            for process in self.workers:
                assert process is None or process.poll() is None, f"a worker exited: {self.logs()}"
            try:
                ready = all(
                    httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
                    for process, port in zip(self.workers, self.metrics_ports)
                    if process is not None
                )
                counted = gauge(f"{self.url}/metrics", "shoal_gateway_workers", pool="default") == count
            except httpx.HTTPError:
                ready = counted = False
            if not (ready and counted):
                seen_at = None
            elif seen_at is None:
                seen_at = time.monotonic()
            elif time.monotonic() - seen_at > 1.2:  # the gateway refreshes the gauge every second
                return
            time.sleep(0.2)
        raise AssertionError(f"the gateway never saw {count} ready workers: {self.logs()}")

    def worker_metric(self, index: int, name: str, **labels) -> float:
        return gauge(f"http://127.0.0.1:{self.metrics_ports[index]}/metrics", name, **labels)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.root.glob("*.log"))

    def stop(self) -> None:
        for process in [self.gateway, *self.workers, self.nats]:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [self.gateway, *self.workers, self.nats]:
            if process is not None:
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()


gauge = metric_total


@pytest.fixture(scope="module")
def cards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cluster-models")
    build_minilm_reranker(root / "reranker")
    build_token_classifier(root / "tagger", seed=3)
    cards = root / "cards"
    cards.mkdir()
    (cards / "reranker.yaml").write_text(reranker_card(RERANKER, root / "reranker", 256))
    (cards / "tagger.yaml").write_text(extract_card(root / "tagger", TAGGER, "token_class"))
    # The reranker's one-logit BERT head read as a text classifier (extract kind classify).
    (cards / "classifier.yaml").write_text(extract_card(root / "reranker", CLASSIFIER, "classify", max_length=256))
    for kind in ("gliclass", "gliner2"):  # the kinds' random models, as tests/kind_models.py builds them
        if importlib.util.find_spec(kind) is not None:
            from kind_models import _build

            (cards / f"{kind}.yaml").write_text(json.dumps({**_build(kind, root / kind), "id": f"test/kind-{kind}"}))
    if importlib.util.find_spec("glirel") is not None:
        from test_glirel import build_glirel, card

        build_glirel(root / "glirel" / "model", seed=3)
        (cards / "glirel.yaml").write_text(card(root / "glirel" / "model"))
    return cards


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, cards):
    c = Cluster(tmp_path_factory.mktemp("cluster"), cards)
    try:
        c.start_nats()
        c.start_worker(0)
        c.start_worker(1)
        c.start_gateway()
        c.wait_for_workers(2)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def single(serve, cards) -> str:
    """`shoal serve` over the same cards: what the cluster must answer."""
    return serve(preload=(MODEL_ID, RERANKER, TAGGER, CLASSIFIER), cards_dirs=(cards,))


def post(url: str, path: str, body: dict, msgpack: bool = False, timeout: float = 120, **headers) -> httpx.Response:
    if msgpack:
        return httpx.post(
            f"{url}{path}",
            content=msgspec.msgpack.encode(body),
            timeout=timeout,
            headers={"content-type": "application/msgpack", "accept": "application/msgpack", **headers},
        )
    return httpx.post(f"{url}{path}", json=body, timeout=timeout, headers=headers)


def body_of(response: httpx.Response, msgpack: bool):
    assert response.status_code == 200, response.text
    return msgspec.msgpack.decode(response.content) if msgpack else response.json()


def vectors(out: dict) -> np.ndarray:
    """The dense vectors of an encode response: lists in JSON, {dtype, shape, data} in msgpack."""

    def array(dense):
        if isinstance(dense, dict):
            dtype = np.dtype(dense["dtype"]).newbyteorder("<")
            return np.frombuffer(dense["data"], dtype=dtype).reshape(dense["shape"])
        return np.asarray(dense, dtype=np.float32)

    return np.stack([array(item["dense"]) for item in out["items"]])


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_the_gateway_answers_as_shoal_serve_does_for_every_verb(cluster, single, lee_documents, msgpack):
    texts = [query_of(d) for d in lee_documents[:6]] + lee_documents[:2]
    encode = {"model": MODEL_ID, "items": [{"text": t} for t in texts]}
    got, want = (body_of(post(url, "/v1/encode", encode, msgpack), msgpack) for url in (cluster.url, single))
    assert np.abs(vectors(got) - vectors(want)).max() <= 1e-5
    assert got["usage"] == want["usage"]

    score = {"model": RERANKER, "query": query_of(lee_documents[3]), "items": [{"text": d} for d in lee_documents[:8]]}
    got, want = (body_of(post(url, "/v1/score", score, msgpack), msgpack) for url in (cluster.url, single))
    assert [r["index"] for r in got["items"]] == [r["index"] for r in want["items"]]
    assert np.allclose([r["score"] for r in got["items"]], [r["score"] for r in want["items"]], atol=1e-5)

    extract = {"model": TAGGER, "items": [{"text": t} for t in texts[:4]]}
    got, want = (body_of(post(url, "/v1/extract", extract, msgpack), msgpack) for url in (cluster.url, single))
    strip = lambda out: [[(e["label"], e["start"], e["end"]) for e in item["entities"]] for item in out["items"]]  # noqa: E731
    assert strip(got) == strip(want) and sum(len(e) for e in strip(got)) > 0
    for a, b in zip(got["items"], want["items"]):
        assert np.allclose([e["score"] for e in a["entities"]], [e["score"] for e in b["entities"]], atol=1e-5)

    classify = {"model": CLASSIFIER, "items": [{"text": t} for t in texts[:4]], "options": {"raw_scores": True}}
    got, want = (body_of(post(url, "/v1/extract", classify, msgpack), msgpack) for url in (cluster.url, single))
    labels = lambda out: [[(x["label"], x["score"]) for x in item["labels"]] for item in out["items"]]  # noqa: E731
    assert [[x for x, _ in row] for row in labels(got)] == [["LABEL_0"]] * 4
    assert np.allclose(
        [s for row in labels(got) for _, s in row], [s for row in labels(want) for _, s in row], atol=1e-5
    )


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_glirel_relations_through_the_gateway_equal_shoal_serves_and_carry_the_registrys_estimate(
    cluster, single, lee_documents, msgpack
):
    """Entities in the call's schema travel gateway -> worker; the relations equal `shoal serve`'s,
    and the call is published with the registry's glirel estimate as its token header."""
    if not (cluster.cards / "glirel.yaml").exists():
        pytest.skip("glirel is not installed")
    texts = [" ".join(d.split()[:40]) for d in lee_documents[:4]]
    schema = {"entities": glirel_schema(tuple(texts))["entities"]}
    body = {
        "model": GLIREL,
        "items": [{"text": t} for t in texts],
        "labels": list(GLIREL_TYPES),
        "schema": schema,
        "options": {"threshold": 0.3},
    }
    response, sent = published(cluster.nats_url, lambda: post(cluster.url, "/v1/extract", body, msgpack))
    got, want = body_of(response, msgpack), body_of(post(single, "/v1/extract", body, msgpack), msgpack)

    def relations(out: dict) -> list:
        return [
            {name: [(r["head"]["start"], r["head"]["end"], r["tail"]["start"], r["tail"]["end"]) for r in found]}
            for item in out["items"]
            for name, found in item["relations"].items()
        ]

    assert relations(got) == relations(want) and sum(len(v) for r in relations(got) for v in r.values()) > 0
    scores = lambda out: [r["score"] for item in out["items"] for v in item["relations"].values() for r in v]  # noqa: E731
    assert np.allclose(scores(got), scores(want), atol=1e-5)
    assert got["usage"] == want["usage"]
    [(headers, _)] = sent
    call = ExtractCall(GLIREL, texts, labels=list(GLIREL_TYPES), threshold=0.3, schema=schema)
    card = Catalog.load(extra_dirs=(cluster.cards,)).get(GLIREL)
    assert int(headers[p.TOKENS]) == estimate_tokens(call, card) == KINDS["extract:glirel"].estimate(call, card) > 0


KIND_CALLS = {
    "gliclass": {"labels": ["sports", "politics", "business"], "options": {"threshold": 0.3}},
    "gliner2": {
        "labels": ["person", "place"],
        "schema": {
            "relations": [{"works_for": {"head": "", "tail": ""}}],
            "classifications": [{"task": "tone", "labels": ["calm", "urgent"]}],
            "structures": {"event": {"fields": ["who::str", "where", "kind::[talk|vote]::str"]}},
        },
        "options": {"threshold": 0.3},
    },
}


def same_but_scores(got, want, tolerance: float = 1e-5) -> bool:
    """Whether two decoded answers are the same, their floats within `tolerance` of each other."""
    if isinstance(got, float) and isinstance(want, float):
        return abs(got - want) <= tolerance
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(same_but_scores(got[k], want[k], tolerance) for k in got)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same_but_scores(g, w, tolerance) for g, w in zip(got, want))
    return bool(got == want)


@pytest.mark.parametrize("kind", list(KIND_CALLS))
def test_gliclass_and_gliner2_through_the_gateway_equal_shoal_serves_and_carry_the_registrys_estimate(
    cluster, single, lee_documents, kind
):
    """A GLiClass call and a GLiNER2 schema (entities, a relation, a classification task, a
    structure) travel gateway -> worker over msgpack; the answer equals `shoal serve`'s, and the call
    is published with the registry's estimate for its kind as its token header."""
    model = f"test/kind-{kind}"
    if not (cluster.cards / f"{kind}.yaml").exists():
        pytest.skip(f"{kind} is not installed")
    texts = [" ".join(d.split()[:40]) for d in lee_documents[:3]]
    body = {"model": model, "items": [{"text": t} for t in texts], **KIND_CALLS[kind]}
    response, sent = published(cluster.nats_url, lambda: post(cluster.url, "/v1/extract", body, True))
    got, want = body_of(response, True), body_of(post(single, "/v1/extract", body, True), True)
    for g, w in zip(got["items"], want["items"]):
        for field in ("entities", "labels", "classifications", "relations", "structures"):
            # Equal but for float32's last bits: the two servers may cut the call into batches of
            # other shapes (their lanes, their load), and a GEMM of another shape sums in another order.
            assert same_but_scores(g.get(field), w.get(field)), (field, g.get(field), w.get(field))
    assert got["usage"] == want["usage"]
    if kind == "gliner2":
        assert all(set(item["structures"]) == {"event"} for item in got["items"])
    [(headers, _)] = sent
    options = KIND_CALLS[kind]["options"]
    call = ExtractCall(
        model,
        texts,
        labels=KIND_CALLS[kind]["labels"],
        threshold=options["threshold"],
        schema=KIND_CALLS[kind].get("schema"),
    )
    card = Catalog.load(extra_dirs=(cluster.cards,)).get(model)
    assert int(headers[p.TOKENS]) == estimate_tokens(call, card) == KINDS[f"extract:{kind}"].estimate(call, card) > 0


def test_the_same_routes_serve_the_real_clients_and_tokenize_through_the_workers(cluster, single, embed_reference):
    import openai

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model=MODEL_ID, input=["a shoal of fish", "the stock market"])
    assert (
        np.abs(
            np.array([d.embedding for d in got.data]) - embed_reference(["a shoal of fish", "the stock market"])
        ).max()
        <= 1e-5
    )
    tokenized = [
        post(url, f"/tokenize?model={MODEL_ID}", {"inputs": "Shoals of fish"}).json() for url in (cluster.url, single)
    ]
    assert tokenized[0] == tokenized[1] and tokenized[0][0][-2]["text"] == "fish"
    listed = {m["id"]: m for m in httpx.get(f"{cluster.url}/v1/models").json()["data"]}
    assert listed[MODEL_ID]["state"] == "loaded" and listed[RERANKER]["tasks"] == ["score"]
    assert listed[UNSERVED]["state"] == "no_worker"


def test_a_model_no_worker_serves_is_503_with_retry_after_and_demand_shows_in_metrics(cluster):
    response = post(cluster.url, "/v1/encode", {"model": UNSERVED, "items": [{"text": "x"}]})
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "no_worker" and UNSERVED in response.json()["error"]["message"]
    assert gauge(f"{cluster.url}/metrics", "shoal_gateway_demand", model=UNSERVED) >= 1
    unknown = post(cluster.url, "/v1/encode", {"model": "no/such-model", "items": [{"text": "x"}]})
    assert unknown.status_code == 404


def test_a_request_over_the_message_limit_round_trips_through_the_object_store(cluster, embed_reference, lee_documents):
    # Long in bytes, short in tokens (the padding is whitespace): a cheap call over the limit.
    texts = [lee_documents[i % len(lee_documents)][:120] + " " * 1400 + f"({i})" for i in range(800)]
    body = {"model": MODEL_ID, "items": [{"text": t} for t in texts]}
    assert len(msgspec.json.encode(body)) > 1 << 20  # the call, and its 800 x 384 float result, are over 1 MiB
    out = body_of(post(cluster.url, "/v1/encode", body, msgpack=True, timeout=300), True)
    got = vectors(out)
    assert got.shape == (800, 384)
    picks = [0, 1, 399, 799]
    assert np.abs(got[picks] - embed_reference([texts[i] for i in picks])).max() <= 1e-5
    page = f"{cluster.url}/metrics"
    assert gauge(page, "shoal_gateway_object_payloads_total", direction="call") >= 1
    assert gauge(page, "shoal_gateway_object_payloads_total", direction="result") >= 1
    assert live_objects(cluster.nats_url) == []  # deleted once answered


def test_a_call_whose_deadline_passes_in_the_queue_is_never_computed(cluster):
    items = lambda: sum(cluster.worker_metric(i, "shoal_items_total", model=MODEL_ID) for i in (0, 1))  # noqa: E731
    before = items()
    for process in cluster.workers:
        process.send_signal(signal.SIGSTOP)  # alive (their heartbeats count for a few seconds) but not pulling
    try:
        started = time.monotonic()
        response = post(
            cluster.url,
            "/v1/encode",
            {"model": MODEL_ID, "items": [{"text": "too late"}], "options": {"timeout_s": 1.0}},
        )
        assert response.status_code == 504, response.text
        assert time.monotonic() - started < 5
    finally:
        for process in cluster.workers:
            process.send_signal(signal.SIGCONT)
    time.sleep(2.0)
    assert items() == before  # no worker computed it after it woke
    ok = post(cluster.url, "/v1/encode", {"model": MODEL_ID, "items": [{"text": "in time"}]})
    assert ok.status_code == 200


def _load(cluster, texts_per_request: list[list[str]]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(texts_per_request)) as pool:
        return list(
            pool.map(
                lambda texts: post(
                    cluster.url, "/v1/encode", {"model": MODEL_ID, "items": [{"text": t} for t in texts]}
                ),
                texts_per_request,
            )
        )


def test_kill_9_of_a_worker_mid_batch_still_answers_every_request_once_and_right(
    cluster, embed_reference, lee_documents
):
    requests = [[f"{query_of(lee_documents[(r + i) % 12])} #{r}.{i}" for i in range(16)] for r in range(24)]
    redelivered_before = cluster.worker_metric(1, "shoal_worker_redelivered_calls_total")
    with ThreadPoolExecutor(1) as side:
        answers = side.submit(_load, cluster, requests)
        deadline = time.monotonic() + 60
        while cluster.worker_metric(0, "shoal_worker_held_tokens") <= 0:  # worker 0 holds calls now
            assert time.monotonic() < deadline and not answers.done(), "worker 0 never took a call"
            time.sleep(0.01)
        cluster.workers[0].kill()  # SIGKILL: no drain, no ack
        responses = answers.result(timeout=240)
    cluster.workers[0].wait()
    for texts, response in zip(requests, responses):
        assert response.status_code == 200, response.text
        assert np.abs(vectors(response.json()) - embed_reference(texts)).max() <= 1e-5
    # Worker 0's unacked calls came back to worker 1 after ack_wait.
    assert cluster.worker_metric(1, "shoal_worker_redelivered_calls_total") > redelivered_before
    cluster.start_worker(0)
    cluster.wait_for_workers(2)


def test_sigterm_drains_a_worker_every_request_answered_and_it_exits_cleanly(cluster, lee_documents):
    requests = [[f"{query_of(lee_documents[(r + i) % 12])} drain {r}.{i}" for i in range(16)] for r in range(16)]
    with ThreadPoolExecutor(1) as side:
        answers = side.submit(_load, cluster, requests)
        deadline = time.monotonic() + 60
        while cluster.worker_metric(1, "shoal_worker_held_tokens") <= 0:
            assert time.monotonic() < deadline and not answers.done()
            time.sleep(0.01)
        cluster.workers[1].send_signal(signal.SIGTERM)
        responses = answers.result(timeout=240)
    assert [r.status_code for r in responses] == [200] * len(requests), [
        r.text for r in responses if r.status_code != 200
    ][:2]
    assert cluster.workers[1].wait(60) == 0
    cluster.start_worker(1)
    cluster.wait_for_workers(2)


def test_a_restarted_gateway_serves_at_once(cluster):
    cluster.gateway.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught (its exit status says why).
    assert cluster.gateway.wait(30) in (0, -signal.SIGTERM)
    cluster.start_gateway()
    deadline = time.monotonic() + 20
    while (
        response := post(cluster.url, "/v1/encode", {"model": MODEL_ID, "items": [{"text": "again"}]})
    ).status_code != 200:
        assert time.monotonic() < deadline, response.text
        time.sleep(0.1)


def test_a_gateway_with_tokens_refuses_requests_without_one(cluster):
    port = free_port()
    gateway = cluster.start_gateway({"SHOAL_AUTH_TOKENS": "cluster-token-0123456789"}, port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        assert post(url, "/v1/encode", {"model": MODEL_ID, "items": [{"text": "x"}]}).status_code == 401
        deadline = time.monotonic() + 20
        while (
            ok := post(
                url,
                "/v1/encode",
                {"model": MODEL_ID, "items": [{"text": "x"}]},
                authorization="Bearer cluster-token-0123456789",
            )
        ).status_code != 200:
            assert time.monotonic() < deadline, ok.text
            time.sleep(0.1)
    finally:
        gateway.terminate()
        gateway.wait(30)


def test_with_nats_down_the_gateway_answers_503_within_the_deadline_and_recovers(cluster):
    cluster.nats.kill()
    cluster.nats.wait()
    time.sleep(0.5)
    started = time.monotonic()
    response = post(
        cluster.url, "/v1/encode", {"model": MODEL_ID, "items": [{"text": "x"}], "options": {"timeout_s": 5.0}}
    )
    assert response.status_code == 503, response.text
    assert time.monotonic() - started < 5.0
    assert response.json()["error"]["code"] == "queue_unavailable" and "retry-after" in response.headers
    assert httpx.get(f"{cluster.url}/readyz").status_code == 503
    cluster.start_nats()  # the same port and store: the queue, its consumers and the workers come back
    deadline = time.monotonic() + 60
    while (
        response := post(cluster.url, "/v1/encode", {"model": MODEL_ID, "items": [{"text": "back"}]})
    ).status_code != 200:
        assert time.monotonic() < deadline, f"{response.text}\n{cluster.logs()}"
        time.sleep(0.2)


def test_dev_cluster_starts_everything_prints_its_url_and_stops_it_all_on_ctrl_c(tmp_path):
    port, metrics_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "shoal.cli",
        "dev-cluster",
        "--workers",
        "1",
        "--port",
        str(port),
        "--models",
        MODEL_ID,
        "--preload",
        MODEL_ID,
        "--store-dir",
        str(tmp_path / "store"),
        "--metrics-port",
        str(metrics_port),
    ]
    process = subprocess.Popen(
        cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("shoal dev-cluster: http://" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stdout.readline())
        url = next(line for line in lines if "shoal dev-cluster: http://" in line).split()[2]
        assert url == f"http://127.0.0.1:{port}"
        nats_port = int(next(line for line in lines if "nats://" in line).split("nats://127.0.0.1:")[1].split()[0])
        while (response := post(url, "/v1/encode", {"model": MODEL_ID, "items": [{"text": "hi"}]})).status_code != 200:
            assert time.monotonic() < deadline, response.text
            time.sleep(0.2)
        assert "shoal_worker_calls_total" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(60) == 0
        for closed in (port, nats_port, metrics_port):  # the gateway, nats-server and the worker are gone
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", closed)) != 0
    finally:
        if process.poll() is None:
            process.kill()
        process.stdout.close()
