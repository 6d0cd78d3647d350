"""Head-of-line blocking (issues 6 and 37): one-sentence latency from 32 clients on model B alone,
and while a 2,048-document bulk request runs on B itself and on another model A; and A's bulk
throughput beside B's clients against A's alone. All in one server process.

One `shoal serve` preloads two models: --small-model, B (default all-MiniLM-L6-v2), which every
one-sentence request goes to, and --other-model, A (default all-mpnet-base-v2). Phases, in order:

  alone        --clients closed-loop clients send one-sentence /v1/encode requests to B for
               --duration-s.
  bulk alone   one bulk request of --bulk-docs documents to A, no clients: A's tokens/s alone.
  same model   the bulk on B; the clients run again from the moment it is sent until it is
               answered (at most --max-bulk-s).
  other model  the bulk on A, the clients on B: B's p99 beside another model's bulk, and A's
               tokens/s beside B's clients.
  alone again  as `alone`: how far the machine drifted during the run (other load on the cores).

The figures of issue 37: p99(loaded) / p99(alone) for the two loaded phases (aim <= 3x), and the
bulk's tokens/s in `other model` / in `bulk alone` (aim >= 0.8). A bulk's tokens/s is its usage
tokens over its wall time, sent to answered (tokenizing and the msgpack answer included, alike in
both phases).
A bulk still unanswered when --max-bulk-s ends is cancelled (the client closes its connection)
and the phase is marked `bulk unfinished`: its figures cover only the first --max-bulk-s.
Before each phase the server's queue must be empty (`shoal_queue_depth` in /metrics).

Texts are real English: the Lee news corpus that the gensim wheel ships
(gensim/test/test_data/lee_background.cor), split into sentences. A one-sentence request sends
one of them; a bulk document is 1-8 consecutive sentences (seeded), repeated to --bulk-docs.
The bulk asks for msgpack so that neither side spends the cores on JSON floats, and passes
options.timeout_s = 600 so that the server's default deadline does not cut it.

The client runs on the server's cores: its CPU time is printed next to the server's.

    python bench/head_of_line.py --duration-s 30 --out head_of_line.json
    python bench/head_of_line.py --duration-s 15 --bulk-docs 256      # a quick check (~4 min)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import msgspec
import numpy as np

from shoal.wire import Timings, Usage
from spawn import free_port, log_tail, machine_line, shoal_command, spawned_server

SMALL_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
OTHER_MODEL = "sentence-transformers/all-mpnet-base-v2"
BULK_TIMEOUT_S = 600.0  # options.timeout_s of the bulk request
AIM_P99_RATIO = 3.0
AIM_BULK_SHARE = 0.8  # the bulk's tokens/s beside the clients, over its tokens/s alone
JSON_HEADERS = {"content-type": "application/json"}
BULK_HEADERS = {"content-type": "application/json", "accept": "application/msgpack"}


# --- texts --------------------------------------------------------------------------------------


def lee_sentences() -> list[list[str]]:
    """The Lee background corpus as paragraphs of sentences, read without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gensim is not installed: it ships the Lee corpus these texts come from")
    path = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data" / "lee_background.cor"
    paragraphs = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [re.split(r"(?<=[.!?])\s+(?=[A-Z0-9\"])", p) for p in paragraphs]


def make_texts(num_docs: int, seed: int) -> tuple[list[str], list[str]]:
    """(one-sentence requests, bulk documents): sentences of 40-300 chars in a seeded order, and
    documents of 1-8 consecutive sentences repeated to `num_docs`."""
    rng = random.Random(seed)
    paragraphs = lee_sentences()
    sentences = [s for p in paragraphs for s in p if 40 <= len(s) <= 300]
    rng.shuffle(sentences)
    docs: list[str] = []
    for p in paragraphs:
        i = 0
        while i < len(p):
            n = rng.randint(1, 8)
            docs.append(" ".join(p[i : i + n]))
            i += n
    return sentences, list(itertools.islice(itertools.cycle(docs), num_docs))


def encode_body(model: str, texts: list[str], options: dict | None = None) -> bytes:
    body: dict = {"model": model, "items": [{"text": t} for t in texts]}
    if options:
        body["options"] = options
    return msgspec.json.encode(body)


# --- wire ---------------------------------------------------------------------------------------


# The response's `usage` and `timings` as shoal's own wire types declare them.


class _Answer(msgspec.Struct):
    usage: Usage
    timings: Timings
    items: list[msgspec.Raw] = []  # counted, never decoded


# --- phases -------------------------------------------------------------------------------------


@dataclass
class Bulk:
    model: str
    docs: int
    tokens: int | None = None
    wall_s: float | None = None
    status: int | None = None
    finished: bool = False  # answered within --max-bulk-s
    server_ms: dict[str, float] | None = None
    error: str | None = None


@dataclass
class Phase:
    name: str
    window_s: float = 0.0
    requests: int = 0
    errors: int = 0
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    # The server's own timings of the one-sentence requests: queue_ms is the share spent waiting.
    server_queue_p50_ms: float | None = None
    server_queue_p99_ms: float | None = None
    server_total_p50_ms: float | None = None  # the server's total_ms: the rest of latency is HTTP and client
    server_total_p99_ms: float | None = None
    client_cpu_cores: float | None = None
    server_cpu_cores: float | None = None
    bulk: Bulk | None = None
    error_examples: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.window_s if self.window_s else 0.0


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process, all threads; None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _percentiles_ms(values_s: list[float], qs: list[float]) -> list[float | None]:
    return (np.percentile(values_s, qs) * 1000.0).tolist() if values_s else [None] * len(qs)


async def small_clients(
    client: httpx.AsyncClient,
    bodies: list[bytes],
    num_clients: int,
    stop: Callable[[], bool],
) -> tuple[list[float], list[tuple[float, float]], list[str]]:
    """Closed-loop clients until `stop()` is true; (latencies s, server (queue_ms, total_ms), errors)."""
    next_k = itertools.count()
    latencies_s: list[float] = []
    server_ms: list[tuple[float, float]] = []
    errors: list[str] = []

    async def loop() -> None:
        while not stop():
            k = next(next_k)
            sent_at = time.perf_counter()
            try:
                response = await client.post("/v1/encode", content=bodies[k % len(bodies)], headers=JSON_HEADERS)
            except httpx.HTTPError as exc:
                errors.append(f"request {k}: {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.05)  # a dead server must not turn this into a busy loop
                continue
            latency_s = time.perf_counter() - sent_at
            if response.status_code != 200:
                errors.append(f"request {k}: HTTP {response.status_code}: {response.text[:200]}")
                await asyncio.sleep(0.05)  # nor refusals: their retries would take the cores from the bulk
                continue
            latencies_s.append(latency_s)
            timings = msgspec.json.decode(response.content, type=_Answer).timings
            server_ms.append((timings.queue_ms, timings.total_ms))

    await asyncio.gather(*(loop() for _ in range(num_clients)))
    return latencies_s, server_ms, errors


async def send_bulk(url: str, bulk: Bulk, body: bytes, max_bulk_s: float) -> None:
    """One bulk request on its own connection; fills `bulk`. Cancelled, it closes that connection."""
    timeout = httpx.Timeout(max_bulk_s + 60.0, connect=10.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        sent_at = time.perf_counter()
        try:
            response = await client.post("/v1/encode", content=body, headers=BULK_HEADERS)
        except httpx.HTTPError as exc:
            bulk.error = f"{type(exc).__name__}: {exc}"
            return
        finally:
            bulk.wall_s = time.perf_counter() - sent_at
        bulk.status = response.status_code
        if response.status_code != 200:
            bulk.error = f"HTTP {response.status_code}: {response.text[:300]}"
            return
        answer = msgspec.msgpack.decode(response.content, type=_Answer)
        bulk.tokens = answer.usage.tokens
        bulk.server_ms = {
            k: getattr(answer.timings, k) for k in ("tokenize_ms", "queue_ms", "inference_ms", "total_ms")
        }
        if len(answer.items) != bulk.docs:
            bulk.error = f"{len(answer.items)} items answered for {bulk.docs} documents"
            return
        bulk.finished = True


async def run_phase(
    name: str,
    client: httpx.AsyncClient,
    url: str,
    server_pid: int,
    bodies: list[bytes],
    num_clients: int,
    *,
    duration_s: float | None = None,
    bulk: Bulk | None = None,
    bulk_body: bytes = b"",
    max_bulk_s: float = 0.0,
) -> Phase:
    """`alone` for `duration_s`, or while `bulk` runs (at most `max_bulk_s`, then it is cancelled)."""
    cpu0 = (process_cpu_s(os.getpid()), process_cpu_s(server_pid))
    started = time.perf_counter()
    bulk_task = None
    if bulk is None:
        deadline = started + (duration_s or 0.0)
        stop = lambda: time.perf_counter() >= deadline  # noqa: E731
    else:
        deadline = started + max_bulk_s
        bulk_task = asyncio.create_task(send_bulk(url, bulk, bulk_body, max_bulk_s))
        stop = lambda: bulk_task.done() or time.perf_counter() >= deadline  # noqa: E731
    try:
        # At --max-bulk-s the bulk's connection is closed (the server drops its queued rest); the
        # one-sentence requests then in flight are still awaited and counted.
        clients = asyncio.ensure_future(small_clients(client, bodies, num_clients, stop))
        if bulk_task is not None:
            await asyncio.wait({bulk_task}, timeout=max_bulk_s)
            if not bulk_task.done():
                bulk_task.cancel()
                bulk.error = f"unfinished after {max_bulk_s:.0f} s (--max-bulk-s); cancelled"
            with contextlib.suppress(asyncio.CancelledError):
                await bulk_task
        latencies_s, totals, errors = await clients
    finally:
        if bulk_task is not None:
            bulk_task.cancel()
    window_s = time.perf_counter() - started
    cpu1 = (process_cpu_s(os.getpid()), process_cpu_s(server_pid))
    queue_ms = [q for q, _ in totals]
    total_ms = [t for _, t in totals]

    p50, p90, p99, pmax = _percentiles_ms(latencies_s, [50, 90, 99, 100])
    q50, q99 = np.percentile(queue_ms, [50, 99]).tolist() if queue_ms else [None, None]
    t50, t99 = np.percentile(total_ms, [50, 99]).tolist() if total_ms else [None, None]
    cores = [None if a is None or b is None else (b - a) / window_s for a, b in zip(cpu0, cpu1)]
    return Phase(
        name=name,
        window_s=window_s,
        requests=len(latencies_s) + len(errors),
        errors=len(errors),
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        max_ms=pmax,
        server_queue_p50_ms=q50,
        server_queue_p99_ms=q99,
        server_total_p50_ms=t50,
        server_total_p99_ms=t99,
        client_cpu_cores=cores[0],
        server_cpu_cores=cores[1],
        bulk=bulk,
        error_examples=errors[:5],
    )


async def queue_depth(client: httpx.AsyncClient) -> float | None:
    text = (await client.get("/metrics")).text
    match = re.search(r"^shoal_queue_depth(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


async def wait_idle(client: httpx.AsyncClient, probe: bytes, timeout_s: float = 300.0) -> bool:
    """True once nothing is admitted and the device has finished its batch, so the next phase
    starts clean. A cancelled bulk leaves the queue at once but its running batch goes on: the
    probe (one sentence) is answered only after that batch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        depth = await queue_depth(client)
        if depth is None or depth == 0:
            with contextlib.suppress(httpx.HTTPError):
                await client.post("/v1/encode", content=probe, headers=JSON_HEADERS, timeout=timeout_s)
            if (await queue_depth(client)) in (None, 0):
                return True
        await asyncio.sleep(0.5)
    return False


async def warm_up(client: httpx.AsyncClient, bodies: list[bytes], models: list[str], docs: list[str]) -> None:
    """Untimed: connections, first-call allocations, each model's batch shapes."""
    requests = [(b, JSON_HEADERS) for b in bodies[:32]] + [(encode_body(m, docs[:64]), BULK_HEADERS) for m in models]
    for body, headers in requests:
        response = await client.post("/v1/encode", content=body, headers=headers)
        if response.status_code != 200:
            raise SystemExit(f"warm-up request failed: HTTP {response.status_code}: {response.text[:300]}")


# --- report -------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


_COLUMNS = [
    ("phase", 11, lambda p, a: p.name),
    ("bulk on", 17, lambda p, a: "-" if p.bulk is None else p.bulk.model.split("/")[-1]),
    ("window s", 8, lambda p, a: f"{p.window_s:.1f}"),
    ("requests", 8, lambda p, a: p.requests),
    ("errors", 6, lambda p, a: p.errors),
    ("req/s", 6, lambda p, a: f"{p.requests_per_s:.1f}"),
    ("p50 ms", 7, lambda p, a: _ms(p.p50_ms)),
    ("p90 ms", 7, lambda p, a: _ms(p.p90_ms)),
    ("p99 ms", 7, lambda p, a: _ms(p.p99_ms)),
    ("max ms", 7, lambda p, a: _ms(p.max_ms)),
    ("srv queue p50/p99", 17, lambda p, a: f"{_ms(p.server_queue_p50_ms)}/{_ms(p.server_queue_p99_ms)}"),
    ("srv total p50/p99", 17, lambda p, a: f"{_ms(p.server_total_p50_ms)}/{_ms(p.server_total_p99_ms)}"),
    (
        "cpu cli/srv",
        11,
        lambda p, a: "-" if p.client_cpu_cores is None else f"{p.client_cpu_cores:.2f}/{p.server_cpu_cores or 0:.2f}",
    ),
    ("p99/alone", 9, lambda p, a: "-" if p.p99_ms is None or not a.p99_ms else f"{p.p99_ms / a.p99_ms:.2f}x"),
]


def print_report(phases: list[Phase]) -> None:
    alone = phases[0]
    print("  ".join(f"{name:>{width}}" for name, width, _ in _COLUMNS))
    for phase in phases:
        print("  ".join(f"{str(get(phase, alone)):>{width}}" for _, width, get in _COLUMNS))
    print()
    for phase in phases:
        if (b := phase.bulk) is None:
            continue
        state = "answered within the window" if b.finished else f"BULK UNFINISHED or failed: {b.error}"
        line = f"bulk ({phase.name}): {b.docs} docs to {b.model}, wall {b.wall_s or 0:.1f} s, {state}"
        if b.tokens is not None:
            line += f"; {b.tokens} tokens, {b.tokens / b.wall_s:.0f} tokens/s"
        if b.server_ms:
            line += "; server ms " + ", ".join(f"{k[:-3]} {v:.0f}" for k, v in b.server_ms.items())
        print(line)
    for phase in phases:
        for example in phase.error_examples:
            print(f"error ({phase.name}): {example}")


def ratios(phases: list[Phase]) -> dict[str, float | None]:
    """p99(phase) / p99(alone) for each phase with both a bulk and clients."""
    alone = phases[0].p99_ms
    return {
        p.name: (p.p99_ms / alone if p.p99_ms and alone else None) for p in phases if p.bulk is not None and p.requests
    }


def bulk_tokens_per_s(phase: Phase) -> float | None:
    b = phase.bulk
    return b.tokens / b.wall_s if b is not None and b.finished and b.tokens and b.wall_s else None


def bulk_share(phases: list[Phase]) -> float | None:
    """The bulk's tokens/s beside the clients (`other model`) over its tokens/s alone (`bulk alone`)."""
    by_name = {p.name: bulk_tokens_per_s(p) for p in phases}
    loaded, alone = by_name.get("other model"), by_name.get("bulk alone")
    return loaded / alone if loaded and alone else None


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds of each `alone` phase (default 30)")
    p.add_argument("--bulk-docs", type=int, default=2048, help="documents in the bulk request (default 2048)")
    p.add_argument("--clients", type=int, default=32, help="closed-loop one-sentence clients (default 32)")
    p.add_argument(
        "--max-bulk-s",
        type=float,
        default=600.0,
        help="longest a loaded phase runs; an unanswered bulk is then cancelled (default 600)",
    )
    p.add_argument(
        "--small-model",
        default=SMALL_MODEL,
        help=f"model of the one-sentence requests and the same-model bulk (default {SMALL_MODEL})",
    )
    p.add_argument("--other-model", default=OTHER_MODEL, help=f"model of the other-model bulk (default {OTHER_MODEL})")
    p.add_argument("--port", type=int, help="port of the spawned server (default: a free one)")
    p.add_argument("--server-args", default="", help="extra arguments for `shoal serve`, one shell-quoted string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the figures and settings as JSON here")
    args = p.parse_args(argv)
    if args.small_model == args.other_model:
        p.error("--other-model must differ from --small-model")
    return args


async def bench(args: argparse.Namespace, url: str, server_pid: int) -> list[Phase]:
    sentences, docs = make_texts(args.bulk_docs, args.seed)
    bodies = [encode_body(args.small_model, [s]) for s in sentences]
    bulk_bodies = {m: encode_body(m, docs, {"timeout_s": BULK_TIMEOUT_S}) for m in (args.small_model, args.other_model)}
    print(
        f"texts:       {len(sentences)} one-sentence requests of 40-300 chars; bulk: {len(docs)} documents of "
        f"{min(map(len, docs))}-{max(map(len, docs))} chars ({len(bulk_bodies[args.small_model]) / 2**20:.1f} MiB of JSON)",
        flush=True,
    )
    limits = httpx.Limits(max_connections=args.clients + 2, max_keepalive_connections=None)
    phases: list[Phase] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(120.0)) as client:
        await warm_up(client, bodies, [args.small_model, args.other_model], docs)
        plan = [
            ("alone", None, args.clients),
            ("bulk alone", args.other_model, 0),
            ("same model", args.small_model, args.clients),
            ("other model", args.other_model, args.clients),
            ("alone again", None, args.clients),
        ]
        for name, bulk_model, num_clients in plan:
            if not await wait_idle(client, bodies[0]):
                print(f"warning: the server's queue was not empty before `{name}`", file=sys.stderr)
            bulk = None if bulk_model is None else Bulk(bulk_model, len(docs))
            print(f"phase {name}...", flush=True)
            phases.append(
                await run_phase(
                    name,
                    client,
                    url,
                    server_pid,
                    bodies,
                    num_clients,
                    duration_s=args.duration_s,
                    bulk=bulk,
                    bulk_body=bulk_bodies.get(bulk_model or "", b""),
                    max_bulk_s=args.max_bulk_s,
                )
            )
    return phases


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` and kill still stop the server
    port = args.port or free_port()
    load_avg = os.getloadavg()
    print(
        f"shoal head-of-line: {args.clients} one-sentence clients on {args.small_model} (B); bulk of "
        f"{args.bulk_docs} docs on B and on {args.other_model} (A)"
    )
    print(machine_line(load_avg, "client and server share the cores"))
    with tempfile.TemporaryDirectory(prefix="shoal-hol-") as tmp:
        log_path = Path(tmp) / "server.log"
        with spawned_server(port, [args.small_model, args.other_model], shlex.split(args.server_args), log_path) as (
            url,
            pid,
        ):
            print(
                f"server:      {' '.join(shoal_command())} serve --port {port} --preload {args.small_model} "
                f"--preload {args.other_model} {args.server_args} (pid {pid})".rstrip(),
                flush=True,
            )
            phases = asyncio.run(bench(args, url, pid))
        server_log = log_tail(log_path)
    print()
    print_report(phases)
    by_phase = ratios(phases)
    print()
    failed_in = {p.name: p.errors for p in phases}
    for name, ratio in by_phase.items():
        verdict = "-" if ratio is None else ("met" if ratio <= AIM_P99_RATIO else "MISSED")
        if failed_in[name]:  # a refused request has no latency: the p99 of the rest says nothing
            verdict = f"MISSED, {failed_in[name]} requests refused or failed"
        print(
            f"p99({name}) / p99(alone) = {'-' if ratio is None else f'{ratio:.2f}x'}  (aim <= {AIM_P99_RATIO:g}x: {verdict})"
        )
    share = bulk_share(phases)
    verdict = "-" if share is None else ("met" if share >= AIM_BULK_SHARE else "MISSED")
    print(
        f"bulk tokens/s (other model) / (bulk alone) = {'-' if share is None else f'{share:.2f}'}"
        f"  (aim >= {AIM_BULK_SHARE:g}: {verdict})"
    )
    unfinished = [p.name for p in phases if p.bulk is not None and not p.bulk.finished]
    if unfinished:
        print(
            f"note: the bulk was not answered within its window in: {', '.join(unfinished)}; those figures cover the window only"
        )
    errors = sum(p.errors for p in phases)
    failed_bulks = [p.name for p in phases if p.bulk is not None and p.bulk.status not in (None, 200)]
    if args.out:
        record = {
            "benchmark": "head_of_line",
            "small_model": args.small_model,
            "other_model": args.other_model,
            "cpu_count": os.cpu_count(),
            "loadavg_at_start": list(load_avg),
            "args": {k: str(v) for k, v in vars(args).items()},
            "phases": [asdict(p) | {"requests_per_s": p.requests_per_s} for p in phases],
            "p99_ratio_vs_alone": by_phase,
            "aim_p99_ratio": AIM_P99_RATIO,
            "bulk_tokens_per_s": {p.name: bulk_tokens_per_s(p) for p in phases if p.bulk is not None},
            "bulk_share_vs_alone": share,
            "aim_bulk_share": AIM_BULK_SHARE,
            "bulk_unfinished_in": unfinished,
        }
        args.out.write_text(json.dumps(record, indent=2))
    if errors or failed_bulks:
        print(
            f"\nFAILED: {errors} one-sentence requests failed, bulk refused in: {', '.join(failed_bulks) or 'none'};"
            f" server log (tail):\n{server_log}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
