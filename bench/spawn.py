"""A real `shoal serve` in a subprocess, for the benchmarks: started on 127.0.0.1, ready once
/readyz answers 200, stopped with SIGTERM (uvicorn shuts down gracefully) when the block ends."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from shoal.bench.targets import free_port, log_tail, shoal_command  # noqa: F401  (re-exported)


@contextlib.contextmanager
def spawned_server(
    port: int, preload: list[str], extra_args: list[str], log_path: Path, ready_timeout_s: float = 300.0
) -> Iterator[tuple[str, int]]:
    """`shoal serve --preload M...` on 127.0.0.1:`port`; yields (url, pid) once /readyz is 200."""
    url = f"http://127.0.0.1:{port}"
    cmd = shoal_command() + ["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    cmd += [a for m in preload for a in ("--preload", m)] + extra_args
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")  # the weights come from installed packages, never the network
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"shoal serve exited with {proc.returncode}:\n{log_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"shoal serve not ready after {ready_timeout_s:.0f} s:\n{log_tail(log_path)}")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def machine_line(load_avg: tuple[float, float, float] | None = None, note: str = "") -> str:
    """The `machine:` line every benchmark prints: cores, architecture, Python, load at start."""
    import platform

    line = f"machine:     {os.cpu_count()} CPU cores ({platform.machine()}, Python {platform.python_version()})"
    if load_avg is not None:
        line += f", load avg {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f} at start"
    return line + (f"; {note}" if note else "")
