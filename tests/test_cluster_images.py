"""Images through the cluster, as `shoal dev-cluster` runs it: a real nats-server, `shoal gateway` and
one `shoal worker` process serving a tiny random-weight CLIP from a folder, real HTTP. An image call
goes gateway → JetStream → worker with its files' bytes in the msgpack call; one over the message
limit goes through the Object Store. The reference is the engine run in this process on the same
bytes and the same card.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import live_objects, metric_total
from shoal.calls import EncodeCall, Item, ScoreCall
from shoal.catalog import parse_card
from shoal.cluster import protocol as p
from shoal.cluster.cli import free_port, start_nats, wait_for_port
from shoal.errors import InvalidRequest
from shoal.verbs import estimate_tokens

pytestmark = pytest.mark.timeout(180)

CLIP_ID = "test/clip-cluster"
COLSMOL_ID = "test/colsmol-cluster"
BAD = b"\x89PNG\r\n\x1a\nnot a png"  # a PNG's signature, then nothing an image decoder reads


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def noise_png(height: int, width: int, seed: int) -> bytes:
    """A PNG of uniform noise: incompressible, so the file is about 3 bytes a pixel."""
    return png(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def gradient_png(color: tuple[int, int, int]) -> bytes:
    pixels = np.zeros((48, 40, 3), dtype=np.uint8)
    pixels[:24] = color
    pixels[24:, :, 1] = np.arange(40, dtype=np.uint8)[None, :] * 6
    return png(pixels)


SMALL = [gradient_png((200, 30, 60)), gradient_png((20, 220, 90)), noise_png(64, 64, 0)]
# Four 640x480 noise PNGs: ~3.7 MB of files, a ~4.9 MB JSON body, a call far over the message limit.
LARGE = [noise_png(480, 640, seed) for seed in range(1, 5)]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@pytest.fixture(scope="module")
def clip_cards(tmp_path_factory) -> tuple[Path, dict]:
    """(cards folder, card fields) of a tiny random-weight CLIP saved with its tokenizer and
    preprocessor config (tests/vision_models.py's shapes and weights)."""
    pytest.importorskip("transformers")
    from vision_models import tiny_clip

    directory, cards = tmp_path_factory.mktemp("clip-cluster"), tmp_path_factory.mktemp("clip-cluster-cards")
    fields = tiny_clip(directory, model_id=CLIP_ID, words=["a", "red", "cat"]).card
    (cards / "clip-cluster.yaml").write_text(json.dumps(fields))  # JSON is YAML
    if importlib.util.find_spec("colpali_engine") is not None:  # the page retriever beside it
        import page_models

        page = page_models.tiny_colsmol(tmp_path_factory.mktemp("colsmol-cluster"), model_id=COLSMOL_ID).card
        (cards / "colsmol-cluster.yaml").write_text(json.dumps(page))
    return cards, fields


class Cluster:
    """nats-server, one gateway and one worker, started as `shoal dev-cluster` starts them."""

    def __init__(self, root: Path, cards: Path) -> None:
        self.root = root
        self.nats_port, self.gateway_port, self.metrics_port = free_port(), free_port(), free_port()
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.worker_metrics = f"http://127.0.0.1:{self.metrics_port}/metrics"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        shoal = [sys.executable, "-m", "shoal.cli"]
        common = [
            "--nats-url",
            self.nats_url,
            "--models-dir",
            str(cards),
            "--models",
            "test/*-cluster",
            "--log-level",
            "warning",
        ]
        self.nats = start_nats(self.nats_port, root / "jetstream", log_file=self._log("nats"))
        self.worker = subprocess.Popen(
            [*shoal, "worker", *common, "--preload", CLIP_ID, "--metrics-port", str(self.metrics_port)],
            env=env,
            stdout=self._log("worker"),
            stderr=subprocess.STDOUT,
        )
        self.gateway = subprocess.Popen(
            [*shoal, "gateway", *common, "--port", str(self.gateway_port)],
            env=env,
            stdout=self._log("gateway"),
            stderr=subprocess.STDOUT,
        )

    def _log(self, name: str):
        return open(self.root / f"{name}.log", "ab")

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Until the gateway listens and counts the worker live (it has loaded the CLIP first)."""
        wait_for_port(self.gateway_port, timeout_s, self.gateway)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.worker.poll() is None, f"the worker exited: {self.logs()}"
            try:
                if metric_total(f"{self.url}/metrics", "shoal_gateway_workers", pool="default") == 1:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the gateway never saw the worker: {self.logs()}")

    def gateway_metric(self, name: str, **labels) -> float:
        return metric_total(f"{self.url}/metrics", name, **labels)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.root.glob("*.log"))

    def stop(self) -> None:
        for process in (self.gateway, self.worker, self.nats):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (self.gateway, self.worker, self.nats):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, clip_cards):
    c = Cluster(tmp_path_factory.mktemp("cluster-images"), clip_cards[0])
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def engine_run(clip_cards):
    """`engine_run(call) -> result` (raising what the engine raises): the engine in this process,
    over the same card: what the cluster must answer."""
    from shoal.catalog import Catalog
    from shoal.config import EngineSettings
    from shoal.engine import Engine

    catalog = Catalog.load(extra_dirs=(clip_cards[0],))
    engine = Engine(EngineSettings(), catalog, allow_download=False)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())

    def run(call):
        return loop.run_until_complete(engine.run(call))

    yield run
    loop.run_until_complete(engine.stop())
    loop.close()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def dense(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray([item["dense"] for item in response.json()["items"]], dtype=np.float32)


def published(nats_url: str, send: Callable[[], httpx.Response]) -> tuple[httpx.Response, list[tuple[dict, int]]]:
    """`send()`'s response, and the (headers, bytes in the message) of each call published on the
    work queue meanwhile: a core NATS subscriber of the stream's subjects sees what JetStream stores."""

    async def main() -> tuple[httpx.Response, list[tuple[dict, int]]]:
        import nats

        nc = await nats.connect(nats_url)
        seen: list[tuple[dict, int]] = []

        async def record(msg) -> None:
            seen.append((dict(msg.headers or {}), len(msg.data)))

        try:
            await nc.subscribe(f"{p.WORK_PREFIX}.>", cb=record)
            await nc.flush()
            response = await asyncio.to_thread(send)
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return response, seen
        finally:
            await nc.close()

    return asyncio.run(main())


def test_image_items_encode_through_the_gateway_as_the_engine_encodes_their_bytes(cluster, clip_cards, engine_run):
    files = [SMALL[0], SMALL[2]]
    items = [{"image": b64(files[0])}, {"text": "a red cat"}, {"image": f"data:image/png;base64,{b64(files[1])}"}]
    call = EncodeCall(CLIP_ID, [Item(image=files[0]), "a red cat", Item(image=files[1])])
    response, [(headers, size)] = published(
        cluster.nats_url, lambda: post(cluster.url, "/v1/encode", {"model": CLIP_ID, "items": items})
    )
    want = engine_run(call)
    np.testing.assert_allclose(dense(response), np.stack(want.vectors), atol=1e-5)
    assert not np.allclose(dense(response)[0], dense(response)[2], atol=1e-3)  # two files embed apart
    # The message is the call, the files' raw bytes in it (not their base64), under the message
    # limit; its token estimate counts each image as the card's image_tokens.
    assert p.OBJECT not in headers and sum(map(len, files)) < size < sum(map(len, files)) + 512
    card = parse_card(clip_cards[1], "<test>")
    text_tokens = estimate_tokens(EncodeCall(CLIP_ID, ["a red cat"]), card)
    assert int(headers[p.TOKENS]) == 2 * card.image_tokens + text_tokens


def test_images_over_the_message_limit_go_through_the_object_store_and_answer_right(cluster, clip_cards, engine_run):
    body = {"model": CLIP_ID, "items": [{"image": b64(f)} for f in LARGE]}
    assert sum(map(len, LARGE)) > 3 << 20  # over three times NATS' default 1 MiB message limit
    response, [(headers, size)] = published(cluster.nats_url, lambda: post(cluster.url, "/v1/encode", body))
    want = engine_run(EncodeCall(CLIP_ID, [Item(image=f) for f in LARGE]))
    np.testing.assert_allclose(dense(response), np.stack(want.vectors), atol=1e-5)
    assert headers[p.OBJECT].startswith("call-") and size == 0  # the message names its object
    assert int(headers[p.TOKENS]) == len(LARGE) * clip_cards[1]["image_tokens"]
    assert live_objects(cluster.nats_url) == []  # deleted once answered


def test_a_bad_image_is_the_engines_400_naming_the_item_not_a_500_or_a_dead_letter(cluster, engine_run):
    items = [{"image": b64(SMALL[0])}, {"image": b64(BAD)}]
    response = post(cluster.url, "/v1/encode", {"model": CLIP_ID, "items": items})
    with pytest.raises(InvalidRequest) as raised:
        engine_run(EncodeCall(CLIP_ID, [Item(image=SMALL[0]), Item(image=BAD)]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == raised.value.code and error["message"] == raised.value.message
    assert "items[1]" in error["message"]
    # Answered and acked at the first delivery: no redelivery, no dead letter.
    assert metric_total(cluster.worker_metrics, "shoal_worker_calls_total", model=CLIP_ID, outcome="error") == 1
    assert metric_total(cluster.worker_metrics, "shoal_worker_redelivered_calls_total", model=CLIP_ID) == 0
    assert cluster.gateway_metric("shoal_dead_letters_total", model=CLIP_ID) == 0


def test_score_ranks_image_documents_for_a_text_query_as_the_engine_does(cluster, engine_run):
    files = [SMALL[0], LARGE[0], SMALL[1], SMALL[2]]
    body = {"model": CLIP_ID, "query": "a red cat", "items": [{"image": b64(f)} for f in files]}
    response = post(cluster.url, "/v1/score", body)
    assert response.status_code == 200, response.text
    want = engine_run(ScoreCall(CLIP_ID, "a red cat", [Item(image=f) for f in files]))
    got = response.json()["items"]
    assert [item["index"] for item in got] == [item.index for item in want.items]
    np.testing.assert_allclose([item["score"] for item in got], [item.score for item in want.items], atol=1e-5)
    assert len({round(item.score, 4) for item in want.items}) == len(files)  # a ranking, not a tie


def test_page_images_encode_and_rank_through_the_gateway_as_the_engine_does(cluster, clip_cards, engine_run):
    """ColSmol's tiled pages through gateway -> JetStream -> worker: the same vectors and ranking."""
    if not (clip_cards[0] / "colsmol-cluster.yaml").is_file():
        pytest.skip("colpali-engine (requirements/test-references.txt) is not installed")
    files = [SMALL[0], LARGE[0], SMALL[2]]
    items = [{"image": b64(f)} for f in files]
    encoded = post(cluster.url, "/v1/encode", {"model": COLSMOL_ID, "items": items})
    assert encoded.status_code == 200, encoded.text
    want = engine_run(EncodeCall(COLSMOL_ID, [Item(image=f) for f in files], outputs=("multivector",)))
    for got, item in zip(encoded.json()["items"], want.items):
        np.testing.assert_allclose(np.asarray(got["multivector"], dtype=np.float32), item.multivector, atol=1e-5)
    ranked = post(cluster.url, "/v1/score", {"model": COLSMOL_ID, "query": "a red cat", "items": items})
    assert ranked.status_code == 200, ranked.text
    want_ranking = engine_run(ScoreCall(COLSMOL_ID, "a red cat", [Item(image=f) for f in files]))
    assert [item["index"] for item in ranked.json()["items"]] == [item.index for item in want_ranking.items]
