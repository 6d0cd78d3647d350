"""The container images, built and run: `deploy/docker/build-images.sh` builds the gateway and CPU
worker images with buildah (or finds them built from the same inputs), and a cluster runs from
them: a real nats-server on loopback that lets in only the gateway's and the workers' users, one
gateway and two workers, each in its image (`deploy/docker/run-image.sh`: `buildah run --isolation
chroot` on the host's network). Encode calls sent to the gateway over HTTP answer what `shoal serve`
in this process answers; each image's HEALTHCHECK passes against its running server; the images
keep their size goals and the gateway stays torch-free.

Slow (a cold build takes minutes) and needs root and buildah: it runs only with SHOAL_TEST_IMAGES=1
(`.ci/run`'s last stage); under CI=true a missing buildah fails it instead of skipping.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import MODEL_ID, metric_total, need_tool, query_of
from shoal.cluster import nats_auth
from shoal.cluster.cli import free_port, start_nats, wait_for_port
from shoal.cluster.nats_auth import GATEWAY, WORKER, server_config

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("SHOAL_TEST_IMAGES") != "1", reason="SHOAL_TEST_IMAGES=1 builds and runs the images"
    ),
    pytest.mark.timeout(1800),
]

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "deploy" / "docker" / "build-images.sh"
RUN = REPO / "deploy" / "docker" / "run-image.sh"
GATEWAY_IMAGE, WORKER_IMAGE = "localhost/shoal-gateway:latest", "localhost/shoal-worker:latest"
# The goals of issue 38: a worker image a fleet can pull when it scales from zero.
GATEWAY_MAX_BYTES, WORKER_MAX_BYTES = 250_000_000, 1_500_000_000
USERS = {GATEWAY: "shoal-gateway", WORKER: "shoal-worker"}


def image_bytes(image: str) -> float:
    """The image's size as buildah reports it (decimal units, as `buildah images` prints)."""
    size = subprocess.run(
        ["buildah", "images", "--noheading", "--format", "{{.Size}}", image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")[0]
    number, unit = re.fullmatch(r"([\d.]+)\s*([kMG]?B)", size.strip()).groups()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def healthcheck_of(image: str) -> list[str]:
    inspected = subprocess.run(
        ["buildah", "inspect", "--type", "image", image], capture_output=True, text=True, check=True
    ).stdout
    test = json.loads(inspected)["Docker"]["config"]["Healthcheck"]["Test"]
    assert test[0] == "CMD", test
    return test[1:]


@pytest.fixture(scope="module")
def images() -> None:
    need_tool(shutil.which("buildah") is not None and os.geteuid() == 0, "buildah (as root) builds the images")
    build = subprocess.run(["bash", str(BUILD), "gateway", "worker"], capture_output=True, text=True, timeout=1500)
    assert build.returncode == 0, build.stderr[-5000:]


class Cluster:
    """nats-server with two users (the chart's and dev-cluster's permissions per role), a gateway and
    two workers run from the images; their output in `root`/*.log."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.passwords = {role: secrets.token_hex(16) for role in USERS}
        users = [
            {"user": USERS[role], "password": self.passwords[role], "permissions": nats_auth.PERMISSIONS[role]}
            for role in USERS
        ]
        config = root / "nats.conf"
        config.write_text(server_config(users))
        self.nats_port, self.gateway_port = free_port(), free_port()
        self.metrics_ports = [free_port(), free_port()]
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.processes: list[subprocess.Popen] = []
        self.processes.append(start_nats(self.nats_port, root / "jetstream", config=config, log_file=self._log("nats")))
        wait_for_port(self.nats_port, 30, self.processes[0])

    def _log(self, name: str):
        return open(self.root / f"{name}.log", "ab")

    def run(self, name: str, role: str, image: str, *args: str) -> subprocess.Popen:
        env = {
            "SHOAL_NATS_URL": f"nats://127.0.0.1:{self.nats_port}",
            "SHOAL_NATS_USER": USERS[role],
            "SHOAL_NATS_PASSWORD": self.passwords[role],
            "HF_HUB_OFFLINE": "1",
            "SHOAL_REDUCED_PRECISION": "false",  # float32, as the in-process `shoal serve` (conftest.py)
        }
        # The password through this process's environment (-e NAME), not on a command line.
        flags = [arg for name in env for arg in ("-e", name)]
        process = subprocess.Popen(
            ["bash", str(RUN), *flags, image, *args],
            env={**os.environ, **env},
            stdout=self._log(name),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def start(self) -> None:
        for index, port in enumerate(self.metrics_ports):
            self.run(f"worker{index}", WORKER, WORKER_IMAGE, "worker", "--models", MODEL_ID, "--preload", MODEL_ID,
                     "--metrics-host", "127.0.0.1", "--metrics-port", str(port))  # fmt: skip
        self.gateway = self.run("gateway", GATEWAY, GATEWAY_IMAGE, "gateway", "--host", "127.0.0.1",
                                "--port", str(self.gateway_port), "--models", MODEL_ID)  # fmt: skip

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Until the gateway is ready and counts two live workers, each ready (its model loaded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in self.processes:
                assert process.poll() is None, f"a part exited: {self.logs()}"
            try:
                ready = all(
                    httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
                    for port in [*self.metrics_ports, self.gateway_port]
                )
                if ready and metric_total(f"{self.url}/metrics", "shoal_gateway_workers") == 2:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the cluster was not ready within {timeout_s} s: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.root.glob("*.log"))

    def stop(self) -> None:
        # run-image.sh passes SIGTERM on to the server and removes its working container.
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


@pytest.fixture(scope="module")
def cluster(images, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("images"))
    try:
        c.start()
        c.wait_ready()
        yield c
    finally:
        c.stop()


def test_gateway_image_is_torch_free_and_both_images_keep_their_size_goals(images):
    gateway, worker = image_bytes(GATEWAY_IMAGE), image_bytes(WORKER_IMAGE)
    assert gateway < GATEWAY_MAX_BYTES, f"gateway image {gateway / 1e6:.0f} MB"
    assert worker < WORKER_MAX_BYTES, f"worker image {worker / 1e9:.2f} GB"
    version = subprocess.run(
        ["bash", str(RUN), GATEWAY_IMAGE, "--version"], capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0 and version.stdout.startswith("shoal "), version.stdout + version.stderr
    probe = "import importlib.util as u; print([m for m in ('torch', 'tokenizers', 'safetensors') if u.find_spec(m)])"
    out = subprocess.run(
        ["bash", str(RUN), "--entrypoint", "python", GATEWAY_IMAGE, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.strip() == "[]", out


def test_encode_through_the_gateway_image_equals_shoal_serve_and_both_workers_compute(cluster, serve, lee_documents):
    texts = [query_of(d) for d in lee_documents[:6]] + lee_documents[:2]
    single = serve()

    def encode(url: str, batch: list[str]) -> dict:
        response = httpx.post(
            f"{url}/v1/encode", json={"model": MODEL_ID, "items": [{"text": t} for t in batch]}, timeout=120
        )
        assert response.status_code == 200, response.text
        return response.json()

    def dense(out: dict) -> np.ndarray:
        return np.asarray([item["dense"] for item in out["items"]], dtype=np.float32)

    got, want = encode(cluster.url, texts), encode(single, texts)
    assert dense(got).shape == (len(texts), 384)
    assert np.abs(dense(got) - dense(want)).max() <= 1e-5
    assert got["usage"] == want["usage"]

    # Many calls at once, so that both workers pull: each answers as `shoal serve` does for its text.
    calls = [texts[i % len(texts) : i % len(texts) + 1] for i in range(48)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda batch: encode(cluster.url, batch), calls))
    for batch, answer in zip(calls, answers):
        want_one = dense(want)[texts.index(batch[0])]
        assert np.abs(dense(answer)[0] - want_one).max() <= 1e-5
    computed = [
        metric_total(f"http://127.0.0.1:{port}/metrics", "shoal_items_total", model=MODEL_ID)
        for port in cluster.metrics_ports
    ]
    assert sum(computed) == len(texts) + len(calls), computed
    assert min(computed) > 0, f"one worker computed nothing: {computed}"


def test_each_images_healthcheck_passes_against_its_running_server(cluster):
    """The HEALTHCHECK command as the image configures it, run in the image against the server the
    cluster runs from it (the host's network: the ports are its loopback's)."""
    for image, port in [(GATEWAY_IMAGE, cluster.gateway_port), (WORKER_IMAGE, cluster.metrics_ports[0])]:
        check = healthcheck_of(image)
        result = subprocess.run(
            ["bash", str(RUN), "-e", f"SHOAL_HEALTH_PORT={port}", "--entrypoint", check[0], image, *check[1:]],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert result.returncode == 0, f"{image}: {result.stdout}{result.stderr}"
        closed = subprocess.run(
            ["bash", str(RUN), "-e", f"SHOAL_HEALTH_PORT={free_port()}", "--entrypoint", check[0], image, *check[1:]],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert closed.returncode != 0, f"{image}: the check passed with nothing listening"
