"""A new user's first requests (issue 34): each model says where its weights are, and a model
whose weights this server cannot get fails at once, says why, names what can serve, and is not
retried: not by the server's Retry-After, not by the SDK. Real servers on loopback, the real SDK
and `shoal models`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import MODEL_ID
from shoal.catalog import resolve

HUB_ONLY = "BAAI/bge-small-en-v1.5"  # a card whose weights only the Hub has (no package ships them)
PACKAGED = "sentence-transformers/all-mpnet-base-v2"  # split across five installed packages


@pytest.fixture(scope="module")
def offline_url(serve) -> str:
    return serve()  # downloads off (HF_HUB_OFFLINE, as the tests run)


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The Hub's endpoint is a loopback port nobody listens on: any download would fail to connect."""
    from huggingface_hub import constants

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(resolve, "_hub_probe", None, raising=False)
    yield
    monkeypatch.setattr(resolve, "_hub_probe", None, raising=False)


def _weights(url: str) -> dict[str, str]:
    return {m["id"]: m.get("weights") for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def test_each_model_in_v1_models_says_whether_its_weights_are_local_downloadable_or_unavailable(serve, offline_url):
    offline = _weights(offline_url)
    assert offline[MODEL_ID] == "local" and offline[PACKAGED] == "local"
    assert offline[HUB_ONLY] == "unavailable"  # not here, and downloads are off
    assert set(offline.values()) <= {"local", "unavailable"}
    online = _weights(serve(preload=(), allow_download=True))
    assert online[HUB_ONLY] == "downloadable" and online[MODEL_ID] == "local"


def _refused_fast(url: str, model: str) -> httpx.Response:
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/encode", json={"model": model, "items": [{"text": "hi"}]}, timeout=60)
    assert time.perf_counter() - started < 2.0
    assert response.status_code == 502, response.text
    assert "retry-after" not in response.headers  # it cannot succeed: nobody should come back for it
    return response


def test_a_model_without_local_weights_fails_at_once_offline_says_why_and_names_what_can_serve(offline_url):
    for _ in range(2):  # the first load and the remembered failure say the same
        error = _refused_fast(offline_url, HUB_ONLY).json()["error"]
        assert "downloads are disabled" in error["message"]
        assert MODEL_ID in error["message"] and PACKAGED in error["details"]["servable"]
        assert error["details"]["weights"] == "unavailable"


def test_with_downloads_allowed_but_no_hub_reachable_it_fails_within_two_seconds(serve, unreachable_hub):
    url = serve(preload=(), allow_download=True)
    error = _refused_fast(url, HUB_ONLY).json()["error"]
    assert "cannot be reached" in error["message"] and MODEL_ID in error["details"]["servable"]


def test_the_sdk_does_not_retry_a_load_that_cannot_succeed(offline_url):
    from shoal.errors import ModelLoadError
    from shoal.sdk import Client

    with Client(offline_url, max_retries=5) as client:
        started = time.perf_counter()
        with pytest.raises(ModelLoadError, match="no weights"):
            client.encode(HUB_ONLY, ["hi"])
        assert time.perf_counter() - started < 2.0  # one answer, no back-off


def test_shoal_models_prints_where_each_models_weights_are():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    lines = subprocess.run(
        [str(Path(sys.executable).parent / "shoal"), "models"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    columns = {line.split()[0]: line.split() for line in lines}
    assert "local" in columns[MODEL_ID] and "local" in columns[PACKAGED]
    assert "unavailable" in columns[HUB_ONLY]
