"""Soak: --duration-s (default 10 minutes) of mixed good and bad requests at moderate load against
one `shoal serve`, its RSS sampled every --sample-s. After warm-up, RSS must stay within +-10 %.

A few clients (--clients, default 4) each send one request, then pause 0.1-1x --max-pause-s
(default 2 s): moderate load, not saturation (each sample prints the server's CPU use to show it). Each request is drawn (seeded) from this mix, with the status it must get:

  good          1-8 short sentences; 1-64 texts of a few words to ~3,000 chars;    200
                msgpack in and out; OpenAI /v1/embeddings (float and base64);
                a 100-document bulk (occasional); one ~1 MiB text (rare, truncated)
  bad           malformed JSON, empty items, unknown option, 2,049 items             400
                unknown model                                                        404
                a text over max_length with truncate: false (~3,000 chars or 1 MiB)  422
                text/plain body                                                      415
                a 9 MiB body (rare)                                                  413 (or a reset while sending)
  disconnect    32 long texts; the client gives up after 10-300 ms and closes        cancelled (200 if it was faster)

RSS is the server process's VmRSS from /proc/PID/status, sampled at the start of the load and
every --sample-s after (its threads and open descriptors with it: a leaked socket per
disconnect shows there). The baseline is the first sample at or after --warmup-s; the figure is
the largest deviation of any later sample from it. Every status is counted per kind; a 500, a
status a kind must not get, a server that is not ready at the end, or RSS outside +-10 % is a
FAIL (exit 1). The server log is kept with --log, else its tracebacks are counted and its tail
printed on failure.

    python bench/soak.py --out soak.json                                   # 10 minutes
    python bench/soak.py --duration-s 60 --sample-s 10 --warmup-s 10        # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import json
import os
import random
import re
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import msgspec
import numpy as np

from spawn import free_port, log_tail, machine_line, shoal_command, spawned_server

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
RSS_TOLERANCE = 0.10
MIB = 2**20
JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}


# --- texts --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Texts:
    sentences: list[str]  # 40-300 chars
    long: list[str]  # ~500-3,000 chars, over all-MiniLM's 256 tokens
    huge: str  # ~1 MiB


def load_texts() -> Texts:
    """Real English: the Lee news corpus the gensim wheel ships, read without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gensim is not installed: it ships the Lee corpus these texts come from")
    path = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data" / "lee_background.cor"
    paragraphs = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    sentences = [s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9\"])", p) if 40 <= len(s) <= 300]
    long = [" ".join(paragraphs[i : i + 3])[:3000] for i in range(0, len(paragraphs) - 2)]
    whole = " ".join(paragraphs)
    huge = (whole * (MIB // len(whole) + 1))[:MIB]
    return Texts(sentences, [t for t in long if len(t) >= 1500], huge)


# --- the mix ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    route: str
    body: bytes
    headers: dict[str, str]
    expected: frozenset[int | str]  # statuses, or "cancelled" / "transport" outcomes
    give_up_s: float | None = None  # disconnect: close the connection after this long


def _encode(model: str, texts: list[str], options: dict | None = None, packer: Callable = msgspec.json.encode) -> bytes:
    body: dict = {"model": model, "items": [{"text": t} for t in texts]}
    if options:
        body["options"] = options
    return packer(body)


def _mixed(rng: random.Random, texts: Texts, n: int) -> list[str]:
    """`n` texts, one in five long (truncated at the model's max_length), the rest a few words to a sentence."""
    return [
        rng.choice(texts.long) if rng.random() < 0.2 else rng.choice(texts.sentences)[: rng.randint(10, 300)]
        for _ in range(n)
    ]


def make_mix(model: str, texts: Texts) -> list[tuple[str, float, Callable[[random.Random], Request]]]:
    """(kind, weight, build) for every kind of request the soak sends."""
    ok = frozenset({200})
    short = lambda r: [r.choice(texts.sentences) for _ in range(r.randint(1, 8))]  # noqa: E731
    return [
        ("good short", 30, lambda r: Request("/v1/encode", _encode(model, short(r)), JSON, ok)),
        (
            "good mixed 1-64",
            15,
            lambda r: Request("/v1/encode", _encode(model, _mixed(r, texts, r.randint(1, 64))), JSON, ok),
        ),
        (
            "good msgpack",
            8,
            lambda r: Request(
                "/v1/encode",
                _encode(model, _mixed(r, texts, r.randint(1, 16)), packer=msgspec.msgpack.encode),
                MSGPACK,
                ok,
            ),
        ),
        (
            "openai float",
            5,
            lambda r: Request("/v1/embeddings", msgspec.json.encode({"model": model, "input": short(r)}), JSON, ok),
        ),
        (
            "openai base64",
            5,
            lambda r: Request(
                "/v1/embeddings",
                msgspec.json.encode({"model": model, "input": r.choice(texts.sentences), "encoding_format": "base64"}),
                JSON,
                ok,
            ),
        ),
        ("bulk 100", 2, lambda r: Request("/v1/encode", _encode(model, _mixed(r, texts, 100)), JSON, ok)),
        (
            "huge text 1 MiB",
            0.5,
            lambda r: Request("/v1/encode", _encode(model, [texts.huge, r.choice(texts.sentences)]), JSON, ok),
        ),
        (
            "bad json",
            3,
            lambda r: Request(
                "/v1/encode", b'{"model": "' + model.encode() + b'", "items": [{"text": "a"', JSON, frozenset({400})
            ),
        ),
        (
            "empty items",
            3,
            lambda r: Request("/v1/encode", msgspec.json.encode({"model": model, "items": []}), JSON, frozenset({400})),
        ),
        (
            "unknown option",
            3,
            lambda r: Request("/v1/encode", _encode(model, short(r), {"normalise": True}), JSON, frozenset({400})),
        ),
        ("too many items", 1, lambda r: Request("/v1/encode", _encode(model, ["a"] * 2049), JSON, frozenset({400}))),
        (
            "unknown model",
            3,
            lambda r: Request("/v1/encode", _encode("no-such/model", short(r)), JSON, frozenset({404})),
        ),
        (
            "too long, no truncate",
            3,
            lambda r: Request(
                "/v1/encode", _encode(model, [r.choice(texts.long)], {"truncate": False}), JSON, frozenset({422})
            ),
        ),
        (
            "1 MiB, no truncate",
            0.3,
            lambda r: Request("/v1/encode", _encode(model, [texts.huge], {"truncate": False}), JSON, frozenset({422})),
        ),
        ("text/plain", 3, lambda r: Request("/v1/encode", b"hello", {"content-type": "text/plain"}, frozenset({415}))),
        (
            "9 MiB body",
            0.2,
            lambda r: Request("/v1/encode", _encode(model, [texts.huge] * 9), JSON, frozenset({413, "transport"})),
        ),
        (
            "disconnect",
            5,
            lambda r: Request(
                "/v1/encode",
                _encode(model, [r.choice(texts.long) for _ in range(32)]),
                JSON,
                frozenset({"cancelled", 200}),
                r.uniform(0.01, 0.3),
            ),
        ),
    ]


# --- load ---------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcome counts per kind, and the latencies of good answers."""

    counts: dict[str, collections.Counter]
    latencies_s: dict[str, list[float]]
    unexpected: list[str]
    server_errors: list[str]  # every 5xx but a 503 (that one is counted as unexpected)

    @classmethod
    def empty(cls) -> Tally:
        return cls(collections.defaultdict(collections.Counter), collections.defaultdict(list), [], [])

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    def by_status(self) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for c in self.counts.values():
            out.update(c)
        return out


async def send(client: httpx.AsyncClient, request: Request) -> tuple[int | str, float, str]:
    """(status or outcome, seconds, a snippet of the answer)."""
    started = time.perf_counter()
    call = client.post(request.route, content=request.body, headers=request.headers)
    try:
        response = await (call if request.give_up_s is None else asyncio.wait_for(call, request.give_up_s))
    except asyncio.TimeoutError:
        return "cancelled", time.perf_counter() - started, ""
    except httpx.HTTPError as exc:
        return "transport", time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
    return (
        response.status_code,
        time.perf_counter() - started,
        response.text[:300] if response.status_code != 200 else "",
    )


async def client_loop(
    client: httpx.AsyncClient,
    mix: list,
    rng: random.Random,
    stop: Callable[[], bool],
    tally: Tally,
    max_pause_s: float,
) -> None:
    kinds, weights, builds = zip(*mix)
    while not stop():
        index = rng.choices(range(len(kinds)), weights=weights)[0]
        request = builds[index](rng)
        outcome, elapsed_s, snippet = await send(client, request)
        kind = kinds[index]
        tally.counts[kind][outcome] += 1
        if outcome == 200:
            tally.latencies_s[kind].append(elapsed_s)
        if isinstance(outcome, int) and outcome >= 500 and outcome != 503:
            tally.server_errors.append(f"{kind}: HTTP {outcome}: {snippet}")
        if outcome not in request.expected:
            tally.unexpected.append(
                f"{kind}: got {outcome}, expected {sorted(map(str, request.expected))}: {snippet[:200]}"
            )
        await asyncio.sleep(rng.uniform(0.1 * max_pause_s, max_pause_s))


# --- RSS ----------------------------------------------------------------------------------------


@dataclass
class Sample:
    t_s: float  # since the load started
    rss_bytes: int
    threads: int
    open_fds: int | None
    requests: int  # answered so far
    server_cpu_cores: float | None = None  # the server's CPU use since the previous sample


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def read_proc(pid: int) -> tuple[int, int, int | None]:
    """(VmRSS bytes, threads, open descriptors) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1))
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE).group(1))
    try:
        fds: int | None = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = None
    return rss_kib * 1024, threads, fds


def take_sample(pid: int, started: float, tally: Tally, cpu: list[float]) -> Sample:
    """One sample; `cpu` holds [perf_counter, server CPU s] of the previous one and is updated."""
    rss, threads, fds = read_proc(pid)
    now, cpu_s = time.perf_counter(), process_cpu_s(pid)
    cores = (cpu_s - cpu[1]) / (now - cpu[0]) if now > cpu[0] else None
    cpu[:] = [now, cpu_s]
    sample = Sample(now - started, rss, threads, fds, tally.total(), cores)
    print(
        f"t={sample.t_s:6.0f} s  rss {rss / MIB:7.1f} MiB  threads {threads:3d}  fds {fds if fds is not None else '?':>4}"
        f"  server cpu {'-' if cores is None else f'{cores:.2f}'} cores"
        f"  answered {sample.requests:6d}  5xx {len(tally.server_errors)}  unexpected {len(tally.unexpected)}",
        flush=True,
    )
    return sample


@dataclass
class RssVerdict:
    baseline: Sample | None
    min_bytes: int | None
    max_bytes: int | None
    max_deviation: float | None  # fraction of the baseline, signed: the sample farthest from it
    passed: bool | None  # None: fewer than two samples after warm-up


def judge_rss(samples: list[Sample], warmup_s: float) -> RssVerdict:
    after = [s for s in samples if s.t_s >= warmup_s - 0.5]  # a sample due at warmup_s counts
    if not after:
        return RssVerdict(None, None, None, None, None)
    base = after[0]
    farthest = max(after, key=lambda s: abs(s.rss_bytes - base.rss_bytes))
    deviation = (farthest.rss_bytes - base.rss_bytes) / base.rss_bytes
    passed = None if len(after) < 2 else abs(deviation) <= RSS_TOLERANCE
    return RssVerdict(base, min(s.rss_bytes for s in after), max(s.rss_bytes for s in after), deviation, passed)


# --- main ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    samples: list[Sample]
    idle_sample: Sample
    tally: Tally
    load_s: float
    ready_after: bool
    good_after: bool
    server_by_status: dict[str, float]  # shoal_requests_total summed by status: 499 counts disconnects


async def soak(args: argparse.Namespace, url: str, pid: int) -> Outcome:
    texts = load_texts()
    mix = make_mix(args.model, texts)
    tally = Tally.empty()
    # One connection per client plus the samplers: a disconnect closes its own and the pool opens anew.
    limits = httpx.Limits(max_connections=args.clients + 2, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(120.0)) as client:
        rss, threads, fds = read_proc(pid)
        idle = Sample(0.0, rss, threads, fds, 0)
        print(f"idle after preload: rss {rss / MIB:.1f} MiB, threads {threads}, fds {fds}", flush=True)
        started = time.perf_counter()
        deadline = started + args.duration_s
        stop = lambda: time.perf_counter() >= deadline  # noqa: E731
        workers = [
            asyncio.ensure_future(
                client_loop(client, mix, random.Random(args.seed * 1000 + i), stop, tally, args.max_pause_s)
            )
            for i in range(args.clients)
        ]
        cpu = [started, process_cpu_s(pid)]
        samples = [take_sample(pid, started, tally, cpu)]
        next_at = started + args.sample_s
        while next_at <= deadline + 0.5:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            samples.append(take_sample(pid, started, tally, cpu))
            next_at += args.sample_s
        # The clients stop sending at the deadline; what is in flight gets up to 60 s more.
        _, pending = await asyncio.wait(workers, timeout=max(0.0, deadline - time.perf_counter()) + 60.0)
        for task in pending:
            task.cancel()
        load_s = time.perf_counter() - started
        for task in workers:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # a bug in this script, not the server's
        ready = (await client.get("/readyz")).status_code == 200
        probe = await client.post("/v1/encode", content=_encode(args.model, ["still serving?"]), headers=JSON)
        by_status: collections.Counter = collections.Counter()
        for status, value in re.findall(
            r'^shoal_requests_total\{[^}]*status="(\d+)"[^}]*\} ([0-9.eE+]+)$',
            (await client.get("/metrics")).text,
            re.MULTILINE,
        ):
            by_status[status] += float(value)
        return Outcome(samples, idle, tally, load_s, ready, probe.status_code == 200, dict(sorted(by_status.items())))


def print_report(args: argparse.Namespace, out: Outcome, verdict: RssVerdict, tracebacks: int) -> None:
    tally = out.tally
    statuses = sorted({s for c in tally.counts.values() for s in c}, key=str)
    print(f"\n{'kind':>22}  " + "  ".join(f"{str(s):>9}" for s in statuses) + "  200 p50 ms  200 p99 ms")
    for kind, counts in sorted(tally.counts.items()):
        lat = tally.latencies_s.get(kind)
        p50, p99 = (f"{v:.1f}" for v in np.percentile(lat, [50, 99]) * 1000) if lat else ("-", "-")
        cells = "  ".join(f"{counts.get(s, 0) or '':>9}" for s in statuses)
        print(f"{kind:>22}  {cells}  {p50:>10}  {p99:>10}")
    by_status = tally.by_status()
    print(
        f"\n{tally.total()} requests in {out.load_s:.0f} s ({tally.total() / out.load_s:.1f}/s) by outcome: "
        + ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items(), key=lambda kv: str(kv[0])))
    )
    print(
        "the server's own count (shoal_requests_total) by status: "
        + (", ".join(f"{s}: {n:.0f}" for s, n in out.server_by_status.items()) or "none found in /metrics")
    )
    print(
        f"5xx other than 503: {len(tally.server_errors)}; outcomes a kind must not get: {len(tally.unexpected)}; "
        f"tracebacks in the server log: {tracebacks}"
    )
    for line in tally.server_errors[:5] + tally.unexpected[:10]:
        print(f"  {line}")
    print(
        f"after the load: /readyz {'200' if out.ready_after else 'NOT ready'}, a one-sentence encode "
        f"{'answered 200' if out.good_after else 'FAILED'}"
    )
    if verdict.baseline is None:
        print(f"RSS: no sample at or after --warmup-s {args.warmup_s:g}")
        return
    base = verdict.baseline
    cores = [s.server_cpu_cores for s in out.samples if s.server_cpu_cores is not None]
    if cores:
        print(f"server CPU: {np.mean(cores):.2f} cores on average over the load (max {max(cores):.2f} in one interval)")
    print(
        f"RSS: idle {out.idle_sample.rss_bytes / MIB:.1f} MiB; baseline {base.rss_bytes / MIB:.1f} MiB at t={base.t_s:.0f} s; "
        f"after warm-up min {verdict.min_bytes / MIB:.1f}, max {verdict.max_bytes / MIB:.1f} MiB; "
        f"max deviation {verdict.max_deviation * 100:+.1f} % (limit +-{RSS_TOLERANCE * 100:.0f} %): "
        + {True: "PASS", False: "FAIL", None: "n/a (fewer than two samples after warm-up)"}[verdict.passed]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between RSS samples (default 30)")
    p.add_argument(
        "--warmup-s", type=float, default=60.0, help="the first sample at or after this is the baseline (default 60)"
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument(
        "--max-pause-s", type=float, default=2.0, help="each client pauses 0.1-1x this between requests (default 2)"
    )
    p.add_argument("--model", default=MODEL, help=f"model of the good requests (default {MODEL})")
    p.add_argument("--port", type=int, help="port of the spawned server (default: a free one)")
    p.add_argument("--server-args", default="", help="extra arguments for `shoal serve`, one shell-quoted string")
    p.add_argument("--log", type=Path, help="keep the server's log here (default: a temporary file)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the figures and settings as JSON here")
    args = p.parse_args(argv)
    if args.sample_s <= 0 or args.duration_s <= 0:
        p.error("--duration-s and --sample-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` and kill still stop the server
    port = args.port or free_port()
    load_avg = os.getloadavg()
    print(
        f"shoal soak: {args.duration_s:g} s of mixed requests from {args.clients} clients on {args.model}, "
        f"RSS every {args.sample_s:g} s, baseline at {args.warmup_s:g} s"
    )
    print(machine_line(load_avg))
    with tempfile.TemporaryDirectory(prefix="shoal-soak-") as tmp:
        log_path = args.log or Path(tmp) / "server.log"
        with spawned_server(port, [args.model], shlex.split(args.server_args), log_path) as (url, pid):
            command = " ".join(
                [*shoal_command(), "serve", "--port", str(port), "--preload", args.model, args.server_args]
            ).rstrip()
            print(f"server:      {command} (pid {pid})", flush=True)
            out = asyncio.run(soak(args, url, pid))
        log_text = log_path.read_text(errors="replace")
        tracebacks = log_text.count("Traceback (most recent call last)")
        tail = log_tail(log_path)
    verdict = judge_rss(out.samples, args.warmup_s)
    print_report(args, out, verdict, tracebacks)
    tally = out.tally
    failures = [
        *(["5xx answers"] if tally.server_errors else []),
        *(["outcomes a kind must not get"] if tally.unexpected else []),
        *(["RSS outside the tolerance"] if verdict.passed is False else []),
        *(["server not serving after the load"] if not (out.ready_after and out.good_after) else []),
    ]
    if args.out:
        record = {
            "benchmark": "soak",
            "model": args.model,
            "cpu_count": os.cpu_count(),
            "loadavg_at_start": list(load_avg),
            "args": {k: str(v) for k, v in vars(args).items()},
            "load_s": out.load_s,
            "idle_sample": asdict(out.idle_sample),
            "samples": [asdict(s) for s in out.samples],
            "rss": {
                "baseline_bytes": verdict.baseline.rss_bytes if verdict.baseline else None,
                "baseline_t_s": verdict.baseline.t_s if verdict.baseline else None,
                "min_bytes_after_warmup": verdict.min_bytes,
                "max_bytes_after_warmup": verdict.max_bytes,
                "max_deviation": verdict.max_deviation,
                "tolerance": RSS_TOLERANCE,
                "passed": verdict.passed,
            },
            "requests": tally.total(),
            "by_status": {str(k): v for k, v in tally.by_status().items()},
            "by_kind": {kind: {str(k): v for k, v in c.items()} for kind, c in tally.counts.items()},
            "good_latency_ms": {
                kind: dict(zip(("p50", "p99"), (np.percentile(lat, [50, 99]) * 1000).tolist()))
                for kind, lat in tally.latencies_s.items()
                if lat
            },
            "server_errors": tally.server_errors,
            "unexpected": tally.unexpected[:100],
            "server_requests_by_status": out.server_by_status,
            "tracebacks_in_log": tracebacks,
            "ready_after": out.ready_after,
            "good_after": out.good_after,
            "failures": failures,
        }
        args.out.write_text(json.dumps(record, indent=2))
    if failures:
        print(f"\nFAILED: {'; '.join(failures)}", file=sys.stderr)
        if tracebacks or tally.server_errors:
            print(f"server log (tail):\n{tail}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
