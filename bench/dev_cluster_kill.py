"""Issue 33's dev-cluster probe: 2,000 one-text `/v1/encode` requests from 8 clients through
`shoal dev-cluster --workers 2`, one worker killed with SIGKILL once 500 have been sent; prints the
answers by status, the worker pids before and after, and dev-cluster's exit and restart lines.

    cd bench && ../.venv/bin/python dev_cluster_kill.py [--port 18080]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def workers_of(pid: int) -> list[int]:
    """The `shoal worker` children of `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().split()[3])
            command = (entry / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        if parent == pid and " worker" in command:
            found.append(int(entry.name))
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    shoal = str(Path(sys.executable).with_name("shoal"))
    command = [shoal, "dev-cluster", "--workers", "2", "--port", str(args.port), "--preload", MODEL]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cluster = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(cluster.stdout or []), daemon=True).start()
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.post(
                f"{url}/v1/encode", json={"model": MODEL, "items": [{"text": "warm"}]}, timeout=30
            ).is_success:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    before = workers_of(cluster.pid)
    statuses: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    sent = [0]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while True:
                with lock:
                    if sent[0] >= args.requests:
                        return
                    sent[0] += 1
                    n = sent[0]
                try:
                    status = str(
                        http.post("/v1/encode", json={"model": MODEL, "items": [{"text": f"request {n}"}]}).status_code
                    )
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with lock:
                    statuses[status] += 1

    clients = [threading.Thread(target=client) for _ in range(8)]
    for thread in clients:
        thread.start()
    while sent[0] < args.requests // 4:
        time.sleep(0.01)
    os.kill(before[0], signal.SIGKILL)
    for thread in clients:
        thread.join()
    after = workers_of(cluster.pid)
    cluster.send_signal(signal.SIGINT)
    cluster.wait(timeout=60)
    restarts = [line.strip() for line in lines if "exited" in line or "started again" in line]
    print(json.dumps({"statuses": statuses, "workers_before": before, "workers_after": after, "restarts": restarts}))


if __name__ == "__main__":
    main()
