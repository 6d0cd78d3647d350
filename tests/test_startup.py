"""`shoal serve`'s first minute (issue 34): one summary line, the port bound before the preloads
load (/readyz says which are loading, then ready), and a preload that fails is one line in the log
and in /readyz, not a traceback, while the other models serve. A real `shoal serve` process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conftest import MODEL_ID
from shoal.bench.targets import free_port

SLOW = "sentence-transformers/all-mpnet-base-v2"  # 420 MB from five packages: seconds to load
MISSING = "BAAI/bge-small-en-v1.5"  # no weights here, downloads off


def test_serve_binds_at_once_reports_loading_then_a_failed_preload_without_a_traceback(tmp_path):
    port = free_port()
    shoal = str(Path(sys.executable).parent / "shoal")
    args = ["serve", "--port", str(port), "--preload", SLOW, "--preload", MISSING, "--preload", MODEL_ID]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [shoal, *args], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        seen: list[dict] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                answer = httpx.get(f"{url}/readyz", timeout=5)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append(answer.json())
            if "failed" in seen[-1] and not seen[-1].get("loading"):
                break
            time.sleep(0.1)
        # Bound before the preloads were warm: the first answer named them loading.
        assert seen[0]["status"] == "loading" and SLOW in seen[0]["loading"], seen[:3]
        final = seen[-1]
        assert final["status"] == "preload failed" and list(final["failed"]) == [MISSING], final
        assert "downloads are disabled" in final["failed"][MISSING]
        # Not ready, but serving: the models that loaded answer.
        encoded = httpx.post(f"{url}/v1/encode", json={"model": MODEL_ID, "items": [{"text": "hi"}]}, timeout=60)
        assert encoded.status_code == 200
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 503
    finally:
        server.terminate()
        server.wait(timeout=30)
    text = log.read_text()
    first = text.splitlines()[0]
    assert first.startswith(f"shoal serve: http://127.0.0.1:{port} · device cpu"), first
    assert "memory budget" in first and "with local weights" in first and f"preloading {SLOW}" in first
    assert f"preload of {MISSING} failed" in text and "Traceback" not in text
