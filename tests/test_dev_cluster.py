"""`shoal dev-cluster` as users run it, on loopback: a part that dies is started again while the
cluster keeps serving, and a dev-cluster killed with SIGKILL takes every part down with it.

Linux only: the processes are read from /proc, and the parts die with dev-cluster through Linux's
parent-death signal.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import MODEL_ID, metric_total
from shoal.cluster.cli import free_port

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the death signal is Linux's"),
]

ACK_WAIT_S = 3.0


# --- processes, read from /proc ------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of `pid`, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


class Proc:
    """One process, told apart from a later one that reuses its pid by its start time."""

    def __init__(self, pid: int, started: int, cmdline: list[str]) -> None:
        self.pid, self.started, self.cmdline = pid, started, cmdline

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[2] == self.started and stat[0] != "Z"  # a zombie has exited

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)

    def role(self) -> str:
        """nats-server, gateway or worker (`python -m shoal.cli worker ...`); "" for one read as it
        vanished, "dev-cluster" for one read between fork and exec."""
        if self.cmdline and Path(self.cmdline[0]).name == "nats-server":
            return "nats-server"
        return self.cmdline[3] if len(self.cmdline) > 3 else ""

    def __repr__(self) -> str:
        return f"{self.pid} {self.role()}"


def children_of(parent: int) -> list[Proc]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) and stat[1] == parent and stat[0] != "Z":
            found.append(Proc(int(entry.name), stat[2], _cmdline(int(entry.name))))
    return found


def port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def free_port_pair() -> int:
    """A free port whose next one is free too (worker i serves /metrics on the base port + i)."""
    while True:
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


# --- dev-cluster -----------------------------------------------------------------------------------


class DevCluster:
    """`shoal dev-cluster` with 2 workers, its output in a log; leaving the block stops it, and kills
    whatever process it started that is still alive (a part it left behind included)."""

    def __init__(self, root: Path, *flags: str) -> None:
        self.port, self.metrics_port = free_port(), free_port_pair()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "dev-cluster.log"
        self.nats_port: int | None = None
        self.seen: dict[tuple[int, int], Proc] = {}
        cmd = [
            sys.executable,
            "-m",
            "shoal.cli",
            "dev-cluster",
            "--workers",
            "2",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--models",
            MODEL_ID,
            "--store-dir",
            str(root / "store"),
            "--threads-per-worker",
            "1",
            "--stop-timeout-s",
            "10",
            *flags,
        ]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=subprocess.STDOUT
            )

    def __enter__(self) -> DevCluster:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for proc in self.seen.values():  # what a dev-cluster that died left behind
            proc.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_started(self, timeout_s: float = 90) -> None:
        """Until dev-cluster prints its URLs (the gateway listens then)."""
        deadline = time.monotonic() + timeout_s
        while "shoal dev-cluster: http://" not in (text := self.output()):
            assert time.monotonic() < deadline and self.process.poll() is None, text[-5000:]
            time.sleep(0.1)
        self.nats_port = int(text.split("nats://127.0.0.1:")[1].split()[0])

    def parts(self) -> list[Proc]:
        """dev-cluster's children now (nats-server, the gateway, the workers), each remembered."""
        found = children_of(self.process.pid)
        for proc in found:
            self.seen[proc.pid, proc.started] = proc
        return found

    def workers(self) -> list[Proc]:
        return [p for p in self.parts() if p.role() == "worker"]

    def wait_for_workers(self, count: int, timeout_s: float) -> None:
        """Until the gateway counts `count` live workers (each has loaded MiniLM first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, self.output()[-5000:]
            try:
                if metric_total(f"{self.url}/metrics", "shoal_gateway_workers", pool="default") == count:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the gateway never saw {count} workers\n{self.output()[-5000:]}"
            time.sleep(0.2)


def _encode_until(url: str, stop: threading.Event, client: int) -> list[str]:
    """POST /v1/encode over and over until `stop`: each answer's status (or the error that came instead)."""
    outcomes = []
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            body = {
                "model": MODEL_ID,
                "items": [{"text": f"client {client} request {len(outcomes)} item {i}"} for i in range(8)],
            }
            try:
                outcomes.append(str(http.post("/v1/encode", json=body).status_code))
            except httpx.HTTPError as exc:
                outcomes.append(type(exc).__name__)
    return outcomes


def test_a_worker_killed_with_kill_9_is_started_again_and_every_request_meanwhile_answers_200(tmp_path):
    with DevCluster(tmp_path, "--preload", MODEL_ID, "--ack-wait-s", str(ACK_WAIT_S)) as cluster:
        cluster.wait_started()
        cluster.wait_for_workers(2, timeout_s=90)
        before = cluster.workers()
        assert len(before) == 2, before
        victim = next(p for p in before if f"{cluster.metrics_port}" in p.cmdline)  # worker 0
        stop = threading.Event()
        with ThreadPoolExecutor(6) as pool:
            load = [pool.submit(_encode_until, cluster.url, stop, client) for client in range(6)]
            try:
                deadline = time.monotonic() + 30
                while metric_total(f"http://127.0.0.1:{cluster.metrics_port}/metrics", "shoal_worker_held_tokens") <= 0:
                    calls = metric_total(f"http://127.0.0.1:{cluster.metrics_port}/metrics", "shoal_worker_calls_total")
                    assert time.monotonic() < deadline, f"worker 0 never held a call ({calls} done)"
                    time.sleep(0.01)
                os.kill(victim.pid, signal.SIGKILL)  # no drain, no ack: its calls come back after ack_wait
                killed_at = time.monotonic()
                while not {p.pid for p in cluster.workers()} - {p.pid for p in before}:
                    assert time.monotonic() < killed_at + 15, f"no new worker\n{cluster.output()[-5000:]}"
                    time.sleep(0.1)
                time.sleep(max(0.0, killed_at + 2 * ACK_WAIT_S - time.monotonic()))  # past a redelivery
            finally:
                stop.set()
            outcomes = [outcome for client in load for outcome in client.result()]
        assert not victim.alive()
        assert len(outcomes) >= 20 and set(outcomes) == {"200"}, sorted(set(outcomes))
        assert "worker 0 exited with signal SIGKILL" in cluster.output()
        now = cluster.workers()
        assert len(now) == 2 and victim.pid not in [p.pid for p in now], now
        cluster.wait_for_workers(2, timeout_s=90)  # the new worker 0 loaded MiniLM and pulls
        response = httpx.post(f"{cluster.url}/v1/encode", json={"model": MODEL_ID, "items": [{"text": "again"}]})
        assert response.status_code == 200, response.text


def test_sigkill_of_dev_cluster_takes_every_part_down_and_frees_their_ports(tmp_path):
    with DevCluster(tmp_path) as cluster:  # no preload: the parts need only to have started
        cluster.wait_started()
        deadline = time.monotonic() + 60
        while any(port_closed(cluster.metrics_port + i) for i in range(2)):  # the workers listen
            assert time.monotonic() < deadline and cluster.process.poll() is None, cluster.output()[-5000:]
            time.sleep(0.1)
        parts = cluster.parts()
        assert sorted(p.role() for p in parts) == ["gateway", "nats-server", "worker", "worker"], parts
        cluster.process.kill()
        cluster.process.wait()
        deadline = time.monotonic() + 10
        while alive := [p for p in parts if p.alive()]:
            assert time.monotonic() < deadline, f"still alive 10 s after dev-cluster's SIGKILL: {alive}"
            time.sleep(0.1)
        ports = [cluster.port, cluster.nats_port, cluster.metrics_port, cluster.metrics_port + 1]
        assert [port for port in ports if not port_closed(port)] == []


def test_nats_server_and_gateway_killed_with_kill_9_come_back_on_their_ports_and_the_cluster_serves(tmp_path):
    with DevCluster(tmp_path, "--preload", MODEL_ID) as cluster:
        cluster.wait_started()
        cluster.wait_for_workers(2, timeout_s=90)
        before = {p.role(): p for p in cluster.parts()}
        for role in ("nats-server", "gateway"):
            os.kill(before[role].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # a new nats-server and gateway; then an encode through both, the workers reconnected
            assert cluster.process.poll() is None, cluster.output()[-5000:]
            now = {p.role(): p for p in cluster.parts()}
            if all(role in now and now[role].pid != before[role].pid for role in ("nats-server", "gateway")):
                try:
                    body = {"model": MODEL_ID, "items": [{"text": "back"}]}
                    if httpx.post(f"{cluster.url}/v1/encode", json=body, timeout=10).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, f"no answer 30 s after the kills\n{cluster.output()[-5000:]}"
            time.sleep(0.2)
        assert now["nats-server"].cmdline == before["nats-server"].cmdline  # its port, its store
        output = cluster.output()
        assert "nats-server exited with signal SIGKILL" in output and "gateway exited with signal SIGKILL" in output
        cluster.wait_for_workers(2, timeout_s=30)
