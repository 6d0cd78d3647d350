"""Overload and abuse against a real `shoal serve` (issue 33's probe, repeated): each scenario
starts its own server on loopback with MiniLM preloaded and prints what a user would see.

  tokenize  --attackers (4) clients each POST /tokenize with a ~7 MB text, --rounds (3) times,
            while /healthz is probed every 50 ms: the probe's longest wait, the attack's time, and
            the server's RSS before, at its peak and 5 s after.
  burst     --requests (600) requests of 16 Lee passages sent at once, beside the same burst on a
            server with the time bound off (`--max-queue-s none`: tokens and items only, as before
            admission by time): admitted and refused, the admitted requests' p50/p99/max, the
            Retry-After told; then each refused request is sent again once, after the time it was
            told, and how many of those are admitted says whether that time was true.
  idle      --idle (5000) silent sockets from 127.0.0.2 (a thread reopens any the server closes),
            then --fresh (13) fresh clients from 127.0.0.1, one a second, each timing one
            /v1/encode: how many were answered within 2 s.

    python bench/overload.py --scenario all --out overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from spawn import free_port, machine_line, spawned_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal.bench.workloads import lee_documents

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
HUGE_TEXT = "the quick brown fox jumps over the lazy dog and keeps on running " * 110_000


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def server(extra: list[str], log_dir: Path, name: str):
    with spawned_server(free_port(), [MODEL], extra, log_dir / f"{name}.log") as (url, pid):
        yield url, pid


def scenario_tokenize(args, log_dir: Path) -> dict:
    with server([], log_dir, "tokenize") as (url, pid):
        before = rss_mib(pid)
        peak = [before]
        waits: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                while not stop.is_set():
                    started = time.perf_counter()
                    http.get("/healthz")
                    waits.append(time.perf_counter() - started)
                    peak.append(rss_mib(pid))
                    time.sleep(0.05)

        statuses: list[int] = []

        def attack() -> None:
            with httpx.Client(base_url=url, timeout=300) as http:
                for _ in range(args.rounds):
                    statuses.append(http.post("/tokenize", json={"inputs": HUGE_TEXT}).status_code)

        prober = threading.Thread(target=probe)
        prober.start()
        started = time.perf_counter()
        attackers = [threading.Thread(target=attack) for _ in range(args.attackers)]
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join()
        attack_s = time.perf_counter() - started
        stop.set()
        prober.join()
        time.sleep(5)
        return {
            "attackers": args.attackers,
            "rounds": args.rounds,
            "text_bytes": len(HUGE_TEXT),
            "statuses": sorted(set(statuses)),
            "attack_s": round(attack_s, 2),
            "healthz_max_s": round(max(waits), 3),
            "healthz_p99_s": round(float(np.percentile(waits, 99)), 3),
            "rss_mib": {"before": round(before), "peak": round(max(peak)), "after_5s": round(rss_mib(pid))},
        }


async def _burst(url: str, n: int, body: dict) -> list[tuple[int, float, float | None, int | None]]:
    """(status, seconds, Retry-After, the status of the one retry) of each of `n` requests sent at
    once; a refused one is sent again once, Retry-After seconds after its refusal (while the burst's
    admitted work still runs), as a client honouring Retry-After does."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one() -> tuple[int, float, float | None, int | None]:
            started = time.perf_counter()
            answer = await http.post("/v1/encode", json=body)
            seconds = time.perf_counter() - started
            told = answer.headers.get("retry-after")
            if answer.status_code != 503 or told is None:
                return answer.status_code, seconds, None, None
            await asyncio.sleep(float(told))
            return answer.status_code, seconds, float(told), (await http.post("/v1/encode", json=body)).status_code

        return await asyncio.gather(*(one() for _ in range(n)))


def _summary(outcomes) -> dict:
    admitted = [s for status, s, _, _ in outcomes if status == 200]
    refused = [(s, r) for status, s, r, _ in outcomes if status == 503]
    told = [r for _, r in refused if r is not None]
    retried = [again for status, _, _, again in outcomes if status == 503 and again is not None]
    out = {
        "admitted": len(admitted),
        "refused": len(refused),
        "other": sorted({status for status, *_ in outcomes if status not in (200, 503)}),
        "admitted_s": {
            "p50": round(float(np.percentile(admitted, 50)), 1),
            "p99": round(float(np.percentile(admitted, 99)), 1),
            "max": round(max(admitted), 1),
            "within_60s": sum(s <= 60 for s in admitted),
        }
        if admitted
        else None,
        "retry_after_s": {"min": min(told), "max": max(told), "distinct": len(set(told))} if told else None,
        "refused_answer_max_s": round(max((s for s, _ in refused), default=0.0), 2),
    }
    if retried:
        out["retried_at_told_time_admitted"] = f"{sum(s == 200 for s in retried)}/{len(retried)}"
    return out


def scenario_burst(args, log_dir: Path) -> dict:
    passages = lee_documents()[:16]
    body = {"model": MODEL, "items": [{"text": p} for p in passages]}
    results = {}
    for name, extra in (("tokens only (--max-queue-s none)", ["--max-queue-s", "none"]), ("by time (default)", [])):
        with server(extra, log_dir, "burst") as (url, _):
            for _ in range(3):  # a measured rate, as on a server that has served before
                httpx.post(f"{url}/v1/encode", json=body, timeout=120).raise_for_status()
            outcomes = asyncio.run(_burst(url, args.requests, body))
            results[name] = _summary(outcomes)
        print(name, json.dumps(results[name]), flush=True)
    return results


def scenario_idle(args, log_dir: Path) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.idle + 4096), hard))
    # The server needs descriptors for 5,000 sockets too: it inherits this limit.
    with server([], log_dir, "idle") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        held: list[socket.socket] = []
        stop = threading.Event()
        opened = [0]

        def connect() -> socket.socket | None:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.2", 0))
                sock.connect(("127.0.0.1", port))
                opened[0] += 1
                return sock
            except OSError:
                sock.close()
                return None

        for _ in range(args.idle):
            if (sock := connect()) is not None:
                held.append(sock)

        def reopen() -> None:  # the attacker replaces every socket the server closes
            while not stop.is_set():
                for index, sock in enumerate(held):
                    sock.setblocking(False)
                    try:
                        closed = sock.recv(1) == b""
                    except BlockingIOError:
                        closed = False
                    except OSError:
                        closed = True
                    if closed:
                        sock.close()
                        if (fresh := connect()) is not None:
                            held[index] = fresh
                time.sleep(0.2)

        reopener = threading.Thread(target=reopen)
        reopener.start()
        times: list[float | None] = []
        body = {"model": MODEL, "items": [{"text": "a fresh client"}]}
        for _ in range(args.fresh):
            started = time.perf_counter()
            try:
                status = httpx.post(f"{url}/v1/encode", json=body, timeout=10).status_code
                times.append(time.perf_counter() - started if status == 200 else None)
            except httpx.HTTPError:
                times.append(None)
            time.sleep(1.0)
        stop.set()
        reopener.join()
        for sock in held:
            sock.close()
        answered = [t for t in times if t is not None]
        return {
            "idle_sockets": args.idle,
            "attacker_connects": opened[0],
            "fresh_answered_within_2s": f"{sum(t <= 2.0 for t in answered)}/{len(times)}",
            "fresh_max_s": round(max(answered), 2) if answered else None,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("tokenize", "burst", "idle", "all"), default="all")
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--idle", type=int, default=5000)
    parser.add_argument("--fresh", type=int, default=13)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(machine_line(), flush=True)
    scenarios = {"tokenize": scenario_tokenize, "burst": scenario_burst, "idle": scenario_idle}
    chosen = list(scenarios) if args.scenario == "all" else [args.scenario]
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            report[name] = scenarios[name](args, Path(tmp))
            print(name, json.dumps(report[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
