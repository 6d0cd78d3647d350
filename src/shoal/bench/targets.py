"""What `shoal bench` measures: servers it starts (shoal serve, Infinity), and the in-process
baselines on the same calls: sentence-transformers on texts, transformers' CLIPModel on images."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..errors import ConfigError
from .tune_gate import min_cosine
from .workloads import Call, Workload

# transformers' CLIPModel is measured at each of these batch sizes; its best counts.
TRANSFORMERS_BATCH_SIZES = (8, 16, 32)
# A baseline's vectors must be this close to shoal's for a ratio to be printed.
MIN_COSINE = 0.9999

_NOT_INHERITED = {
    "SHOAL_AUTH_TOKENS",
    "SHOAL_AUTH_TOKENS_FILE",
    "SHOAL_ADMIN_TOKENS",
    "SHOAL_MODELS",
    "SHOAL_DEVICE",
    "SHOAL_MODELS_DIRS",
    "SHOAL_HOST",
    "SHOAL_PORT",
    # What the bench server serves is the bench's to say: which models are pinned, their aliases,
    # and whether weights may be downloaded.
    "SHOAL_PINNED_MODELS",
    "SHOAL_ALIASES",
    "SHOAL_ALLOW_DOWNLOAD",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shoal_command() -> list[str]:
    script = Path(sys.executable).with_name("shoal")  # the venv's entry point, as a user runs it
    return [str(script)] if script.exists() else [sys.executable, "-m", "shoal.cli"]


@contextlib.contextmanager
def spawned(
    cmd: list[str], ready_url: str, log_path: Path, *, env: dict[str, str] | None = None, ready_timeout_s: float = 300.0
) -> Iterator[int]:
    """Runs `cmd` until the block ends (SIGTERM, then SIGKILL after 20 s); yields its pid once
    `ready_url` answers 200."""
    # The user's server settings stay out of the servers measured here: tokens would refuse the
    # load's requests, SHOAL_MODELS could leave the model out, SHOAL_DEVICE move it off this CPU.
    full_env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    full_env.setdefault("HF_HUB_OFFLINE", "1")  # weights come from local folders, never the network
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise ConfigError(f"{cmd[0]} exited with {proc.returncode}:\n{log_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ConfigError(f"{cmd[0]} not ready after {ready_timeout_s:.0f} s:\n{log_tail(log_path)}")
            time.sleep(0.2)
        yield proc.pid
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def log_tail(path: Path, num_lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


@contextlib.contextmanager
def shoal_serve(
    model: str, log_path: Path, *, args: Sequence[str] = (), env: dict[str, str] | None = None, port: int | None = None
) -> Iterator[tuple[str, int]]:
    """`shoal serve --preload MODEL` on loopback; yields (url, pid) once ready."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = shoal_command() + [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--preload",
        model,
        *args,
    ]
    with spawned(cmd, f"{url}/readyz", log_path, env=env) as pid:
        yield url, pid


def served_precision(url: str, model_id: str, token: str | None) -> str | None:
    """What the server says the model computes in (`GET /v1/models/{id}`), or None (an older
    server, a gateway without workers)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.get(f"{url}/v1/models/{model_id}", headers=headers, timeout=30)
        return answer.json().get("precision") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def infinity_serve(
    command: str, model_dir: Path, log_path: Path, *, batch_size: int = 32, served_name: str = "model"
) -> Iterator[tuple[str, int]]:
    """Infinity (`infinity_emb v2`, from its own virtualenv: `command` is the path of its
    `infinity_emb` script) serving a local model folder on CPU with its torch engine."""
    if not (Path(command).is_file() or shutil.which(command)):
        raise ConfigError(
            f"--infinity {command}: no such program (the `infinity_emb` script of a venv "
            "with infinity-emb[server,torch]; see docs/bench.md)"
        )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        command,
        "v2",
        "--model-id",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--engine",
        "torch",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--batch-size",
        str(batch_size),
        "--log-level",
        "warning",
        "--no-compile",
        "--no-bettertransformer",
        "--no-vector-disk-cache",
    ]
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "DO_NOT_TRACK": "1",
    }
    with spawned(cmd, f"{url}/health", log_path, env=env) as pid:
        yield url, pid


@dataclass
class InProcess:
    """sentence-transformers in this process on exactly the texts of `num_calls` calls, each call
    one `encode` (batch_size = the call's texts), so its figure is the library's best on that batching."""

    calls: int
    items: int
    tokens: int
    wall_s: float
    batch_size: int | None = None  # the batch it was measured at, when the call's size is not it
    items_per_s_by_batch_size: dict[int, float] = field(default_factory=dict)  # each batch size tried

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.wall_s


def sentence_transformers_baseline(
    model_dir: Path, workload: Workload, *, duration_s: float, device: str = "cpu"
) -> InProcess:
    if workload.verb != "encode":
        raise ConfigError(f"the in-process baseline embeds; workload {workload.name!r} is {workload.verb}")
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise ConfigError("--against st needs sentence-transformers: pip install sentence-transformers") from exc
    model = SentenceTransformer(str(model_dir), device=device)
    tokenizer, limit = model.tokenizer, model.max_seq_length
    calls = workload.calls
    model.encode(list(calls[0].texts), batch_size=len(calls[0].texts))  # warm-up
    num_calls = items = tokens = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s:
        texts = list(calls[num_calls % len(calls)].texts)
        model.encode(texts, batch_size=len(texts))
        num_calls += 1
        items += len(texts)
    wall_s = time.perf_counter() - start
    for k in range(num_calls):  # counted after the clock: the library's own tokenizer, its truncation
        texts = list(calls[k % len(calls)].texts)
        tokens += sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=limit)["input_ids"])
    return InProcess(num_calls, items, tokens, wall_s)


def served_vectors(url: str, model: str, call: Call, *, token: str | None = None) -> list[list[float]]:
    """The server's dense vectors for `call`'s items (JSON, images as base64), in order."""
    items = [{"text": t} for t in call.texts] + [{"image": base64.b64encode(f).decode("ascii")} for f in call.images]
    headers = {"authorization": f"Bearer {token}"} if token else {}
    answer = httpx.post(f"{url}/v1/encode", json={"model": model, "items": items}, headers=headers, timeout=600)
    if answer.status_code != 200:
        raise ConfigError(f"{url}/v1/encode answered {answer.status_code} to the first call: {answer.text[:500]}")
    return [[float(x) for x in item["dense"]] for item in answer.json()["items"]]


def served_scores(url: str, model: str, call: Call, *, token: str | None = None) -> list[float]:
    """The server's raw scores (`raw_scores`, no activation) of `call`'s query against each text, in
    the texts' order."""
    items = [{"text": t} for t in call.texts]
    body = {"model": model, "query": call.query, "items": items, "options": {"raw_scores": True}}
    headers = {"authorization": f"Bearer {token}"} if token else {}
    answer = httpx.post(f"{url}/v1/score", json=body, headers=headers, timeout=600)
    if answer.status_code != 200:
        raise ConfigError(f"{url}/v1/score answered {answer.status_code} to the first call: {answer.text[:500]}")
    scores = [0.0] * len(call.texts)
    for item in answer.json()["items"]:
        scores[int(item["index"])] = float(item["score"])
    return scores


def transformers_clip_baseline(
    model_dir: Path,
    workload: Workload,
    *,
    duration_s: float,
    served: list[list[float]],
    tokens_per_image: int,
    batch_sizes: Sequence[int] = TRANSFORMERS_BATCH_SIZES,
    bar: float = MIN_COSINE,
) -> tuple[float, InProcess | None]:
    """transformers' CLIPModel in this process on the workload's image files: `PIL.Image.open` +
    `CLIPImageProcessorPil` + `get_image_features` under `torch.inference_mode`, from the bytes to
    normalised vectors, each of `batch_sizes` for `duration_s` (the files in call order), its best
    kept. First its vectors for the first call's images are compared with `served` (shoal's for the
    same files): (the smallest cosine, the best figure), or (that cosine, None) when it is under
    `bar`: outputs that differ get no figure to compare."""
    if workload.modality != "image":
        raise ConfigError(f"the CLIPModel baseline embeds images; workload {workload.name!r} sends texts")
    config_path = model_dir / "config.json"
    model_type = json.loads(config_path.read_text()).get("model_type") if config_path.is_file() else None
    if model_type != "clip":
        raise ConfigError(
            f"--against transformers runs transformers' CLIPModel: {model_dir} is not a transformers CLIP "
            f"folder (config.json's model_type: {model_type!r})"
        )
    try:
        import numpy as np
        import torch
        import transformers
        from PIL import Image
    except ImportError as exc:
        raise ConfigError(
            "--against transformers needs transformers and pillow: pip install transformers pillow"
        ) from exc
    transformers.utils.logging.disable_progress_bar()  # its weight-loading bar, between the bench's lines
    model = transformers.CLIPModel.from_pretrained(str(model_dir)).eval()
    processor = transformers.CLIPImageProcessorPil.from_pretrained(str(model_dir))

    @torch.inference_mode()
    def embed(files: Sequence[bytes]) -> np.ndarray:
        images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
        pixel_values = torch.from_numpy(np.asarray(processor(images, return_tensors="np")["pixel_values"]))
        features = model.get_image_features(pixel_values=pixel_values)
        if not isinstance(features, torch.Tensor):  # transformers 5 returns the tower's output
            features = features.pooler_output
        return torch.nn.functional.normalize(features, dim=-1).numpy()

    cosine = min_cosine(served, embed(workload.calls[0].images).tolist())
    if not cosine >= bar:  # NaN included
        return cosine, None
    files = [f for call in workload.calls for f in call.images]

    def batch(first: int, size: int) -> list[bytes]:
        return [files[(first + i) % len(files)] for i in range(size)]

    best, rates = None, {}
    for batch_size in batch_sizes:
        embed(batch(0, batch_size))  # warm-up at this batch's shapes
        num_batches = items = 0
        start = time.perf_counter()
        while time.perf_counter() - start < duration_s:
            embed(batch(items, batch_size))
            num_batches += 1
            items += batch_size
        figure = InProcess(num_batches, items, items * tokens_per_image, time.perf_counter() - start, batch_size)
        rates[batch_size] = figure.items_per_s
        if best is None or figure.items_per_s > best.items_per_s:
            best = figure
    assert best is not None  # batch_sizes is not empty
    best.items_per_s_by_batch_size = rates
    return cosine, best
