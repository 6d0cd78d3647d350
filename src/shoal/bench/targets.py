"""What `shoal bench` measures: servers it starts (shoal serve, Infinity) and the in-process
sentence-transformers baseline on the same texts."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..errors import ConfigError
from .workloads import Workload

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
