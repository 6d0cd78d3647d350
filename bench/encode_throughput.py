"""Encode throughput: shoal over HTTP against sentence-transformers in-process, on the same texts,
measured in the same run.

Two workloads on sentence-transformers/all-MiniLM-L6-v2:

  single  one sentence per request from --concurrency clients (default 32). Baseline: one
          `SentenceTransformer.encode` call over the same sentences, batch_size=32 (ST's default).
  batch   64 texts of mixed length (a few words to ~200 tokens) per request from --batch-clients
          clients (default 4). Baseline: `encode` of the same 64-text groups, batch_size=64.

Texts are built from the model's vocab.txt with a seeded generator, so every run sends the same
sequence; request k sends body k mod pool size, and the baseline encodes exactly the prefix of
that sequence the HTTP run got through. Tokens are counted once per text with the model's
tokenizer (special tokens included, truncated at max_seq_length); shoal's usage.tokens must match
that count on every response. Before anything is timed, a sample of shoal's vectors is compared
with ST's (cosine >= 0.9999): a fast-but-wrong server exits 1 without a figure.

The load generator, the server and the baseline share this machine's cores. HTTP runs and
baselines run one after the other (the server sits idle during a baseline), but the client's CPU
time is taken from the server: it is printed next to the server's so the figures can be read
as the lower bounds they are.

One self-contained file on purpose (past the usual ~500 lines): it runs from a checkout with
only the dev extras installed and imports nothing from shoal but the catalog.

    python bench/encode_throughput.py --duration-s 20
    python bench/encode_throughput.py --url http://127.0.0.1:8080 --msgpack --json-out out.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from shoal.wire import Timings, Usage
from spawn import free_port, log_tail, machine_line, spawned_server

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
MIN_COSINE = 0.9999
NUM_SENTENCES = 4096  # pool for the single workload; request k sends sentence k mod this
NUM_GROUPS = 32  # pool for the batch workload
GROUP_SIZE = 64
ST_DEFAULT_BATCH_SIZE = 32


# --- texts and tokens ---------------------------------------------------------------------------


def load_words(model_dir: Path) -> list[str]:
    """Whole lowercase words from the model's vocab: each is one token, so word count ~ tokens."""
    vocab = (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    return [w for w in vocab if len(w) >= 3 and w.isascii() and w.isalpha() and w.islower()]


def make_text(rng: random.Random, words: list[str], num_words: int) -> str:
    picked = [w + "," if rng.random() < 0.08 else w for w in rng.choices(words, k=num_words)]
    text = " ".join(picked).rstrip(",")
    return text[0].upper() + text[1:] + "."


def make_texts(words: list[str], seed: int) -> tuple[list[str], list[list[str]]]:
    """`NUM_SENTENCES` sentences of 6-24 words and `NUM_GROUPS` groups of 64 texts of 2-180 words."""
    rng = random.Random(seed)
    sentences = [make_text(rng, words, rng.randint(6, 24)) for _ in range(NUM_SENTENCES)]
    groups = [[make_text(rng, words, rng.randint(2, 180)) for _ in range(GROUP_SIZE)] for _ in range(NUM_GROUPS)]
    return sentences, groups


class TokenCounter:
    """Real tokens per text with the model's own tokenizer, as ST and shoal both feed the model."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        max_length = json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=max_length)

    def count(self, texts: list[str]) -> list[int]:
        return [len(enc.ids) for enc in self._tokenizer.encode_batch(texts)]


# --- wire ---------------------------------------------------------------------------------------


# The response's `usage` and `timings` as shoal's own wire types declare them.


class UsageOnly(msgspec.Struct):
    usage: Usage  # the hot path skips the vectors without building them
    timings: Timings | None = None


class _Item(msgspec.Struct):
    dense: Any


class _Full(msgspec.Struct):
    items: list[_Item]
    usage: Usage


@dataclass(frozen=True)
class Codec:
    name: str  # "json" | "msgpack"

    @property
    def media_type(self) -> str:
        return f"application/{self.name}"

    @property
    def headers(self) -> dict[str, str]:
        return {"content-type": self.media_type, "accept": self.media_type}

    def body(self, texts: list[str]) -> bytes:
        request = {"model": MODEL, "items": [{"text": t} for t in texts]}
        return msgspec.msgpack.encode(request) if self.name == "msgpack" else msgspec.json.encode(request)

    def decode(self, content: bytes, typ: type) -> Any:
        return (
            msgspec.msgpack.decode(content, type=typ)
            if self.name == "msgpack"
            else msgspec.json.decode(content, type=typ)
        )


def dense_vector(dense: Any) -> np.ndarray:
    """A vector from either wire form: msgpack `{dtype, shape, data}` or a JSON list."""
    if isinstance(dense, dict):
        return np.frombuffer(dense["data"], dtype=np.dtype(dense["dtype"]).newbyteorder("<")).reshape(dense["shape"])
    return np.asarray(dense, dtype=np.float32)


# --- the HTTP load ------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str  # "single" | "batch"
    groups: list[list[str]]  # request k sends groups[k % len(groups)]
    tokens: list[int]  # real tokens of each group, what usage.tokens must say
    clients: int
    baseline_batch_size: int
    one_baseline_call: bool  # single: one encode over all sentences; batch: one encode per group

    def sent(self, num_requests: int) -> list[list[str]]:
        return [self.groups[k % len(self.groups)] for k in range(num_requests)]


@dataclass
class Row:
    workload: str
    runner: str
    clients: int | None
    items_per_request: int
    requests: int
    items: int
    tokens: int
    wall_s: float
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    client_cpu_cores: float | None = None
    server_cpu_cores: float | None = None
    vs_baseline: float | None = None  # shoal tokens/s over the baseline's, on the same texts
    # Means of the server's own `timings` per request: where the latency goes inside the server.
    server_mean_ms: dict[str, float] | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process, all threads; None off Linux or without a pid."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def run_http(
    client: httpx.AsyncClient,
    codec: Codec,
    work: Workload,
    *,
    duration_s: float,
    max_requests: int | None,
    server_pid: int | None,
) -> Row:
    bodies = [codec.body(g) for g in work.groups]  # encoded once, outside the timed loop
    headers = codec.headers
    next_k = itertools.count()
    latencies_s: list[float] = []
    errors: list[str] = []
    answered: list[int] = []  # body index of each request answered 200
    server_ms: list[tuple[float, float, float, float]] = []  # tokenize, queue, inference, total
    issued = 0

    async def client_loop() -> None:
        nonlocal issued
        while True:
            k = next(next_k)  # draw and check with no await between: sent requests are a prefix
            if (max_requests is not None and k >= max_requests) or (
                max_requests is None and time.perf_counter() >= deadline
            ):
                return
            issued = max(issued, k + 1)
            index = k % len(bodies)
            sent_at = time.perf_counter()
            try:
                response = await client.post("/v1/encode", content=bodies[index], headers=headers)
            except httpx.HTTPError as exc:
                errors.append(f"request {k}: {type(exc).__name__}: {exc}")
                continue
            latency_s = time.perf_counter() - sent_at
            if response.status_code != 200:
                errors.append(f"request {k}: HTTP {response.status_code}: {response.text[:200]}")
                continue
            decoded = codec.decode(response.content, UsageOnly)
            if decoded.usage.tokens != work.tokens[index]:
                errors.append(
                    f"request {k}: usage.tokens {decoded.usage.tokens} != tokenizer count {work.tokens[index]}"
                )
            if (t := decoded.timings) is not None:
                server_ms.append((t.tokenize_ms, t.queue_ms, t.inference_ms, t.total_ms))
            latencies_s.append(latency_s)
            answered.append(index)

    client_cpu0, server_cpu0 = process_cpu_s(os.getpid()), process_cpu_s(server_pid)
    started = time.perf_counter()
    deadline = started + duration_s
    await asyncio.gather(*(client_loop() for _ in range(work.clients)))
    wall_s = time.perf_counter() - started
    client_cpu1, server_cpu1 = process_cpu_s(os.getpid()), process_cpu_s(server_pid)

    p50, p95, p99 = (np.percentile(latencies_s, [50, 95, 99]) * 1000.0).tolist() if latencies_s else (None,) * 3
    return Row(
        workload=work.name,
        runner=f"shoal http {codec.name}",
        clients=work.clients,
        items_per_request=len(work.groups[0]),
        requests=issued,
        items=sum(len(work.groups[i]) for i in answered),
        tokens=sum(work.tokens[i] for i in answered),
        wall_s=wall_s,
        p50_ms=p50,
        p95_ms=p95,
        p99_ms=p99,
        mean_ms=float(np.mean(latencies_s)) * 1000.0 if latencies_s else None,
        client_cpu_cores=None if client_cpu0 is None else (client_cpu1 - client_cpu0) / wall_s,
        server_cpu_cores=None if server_cpu0 is None else (server_cpu1 - server_cpu0) / wall_s,
        server_mean_ms=dict(zip(("tokenize", "queue", "inference", "total"), np.mean(server_ms, axis=0).tolist()))
        if server_ms
        else None,
        errors=errors,
    )


async def warm_up(client: httpx.AsyncClient, codec: Codec, work: Workload, num_requests: int) -> None:
    """Untimed requests: first-call allocations, connection setup, the server's lazy paths."""
    bodies = [codec.body(g) for g in work.groups[:num_requests]]
    responses = await asyncio.gather(*(client.post("/v1/encode", content=b, headers=codec.headers) for b in bodies))
    for response in responses:
        if response.status_code != 200:
            raise SystemExit(f"warm-up request failed: HTTP {response.status_code}: {response.text[:300]}")


# --- the baseline -------------------------------------------------------------------------------


def run_baseline(st_model: Any, work: Workload, num_requests: int) -> Row:
    groups = work.sent(num_requests)
    started = time.perf_counter()
    if work.one_baseline_call:
        st_model.encode([g[0] for g in groups], batch_size=work.baseline_batch_size, show_progress_bar=False)
    else:
        for group in groups:
            st_model.encode(group, batch_size=work.baseline_batch_size, show_progress_bar=False)
    wall_s = time.perf_counter() - started
    tokens = sum(work.tokens[k % len(work.groups)] for k in range(num_requests))
    return Row(
        workload=work.name,
        runner=f"ST encode bs={work.baseline_batch_size}",
        clients=None,
        items_per_request=len(work.groups[0]),
        requests=num_requests,
        items=sum(len(g) for g in groups),
        tokens=tokens,
        wall_s=wall_s,
    )


# --- correctness --------------------------------------------------------------------------------


async def check_correctness(
    client: httpx.AsyncClient,
    codec: Codec,
    st_model: Any,
    counter: TokenCounter,
    sentences: list[str],
    groups: list[list[str]],
) -> tuple[list[str], str]:
    """Shoal's vectors against ST's on 32 sentences (one per request) and 2 groups of 64."""
    requests = [[s] for s in sentences[:32]] + groups[:2]
    responses = await asyncio.gather(
        *(client.post("/v1/encode", content=codec.body(r), headers=codec.headers) for r in requests)
    )
    failures: list[str] = []
    texts: list[str] = []
    vectors: list[np.ndarray] = []
    for request, response in zip(requests, responses):
        if response.status_code != 200:
            failures.append(f"HTTP {response.status_code}: {response.text[:200]}")
            continue
        decoded = codec.decode(response.content, _Full)
        if len(decoded.items) != len(request):
            failures.append(f"{len(decoded.items)} vectors for {len(request)} items")
            continue
        expected_tokens = sum(counter.count(request))
        if decoded.usage.tokens != expected_tokens:
            failures.append(f"usage.tokens {decoded.usage.tokens} != tokenizer count {expected_tokens}")
        texts += request
        vectors += [dense_vector(item.dense).astype(np.float32) for item in decoded.items]
    if not texts:
        return failures, "no response to check"
    ours = np.stack(vectors)  # [n, 384]
    theirs = np.asarray(st_model.encode(texts, batch_size=GROUP_SIZE, show_progress_bar=False), dtype=np.float32)
    cosines = np.sum(ours * theirs, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    for i in np.flatnonzero(~(cosines >= MIN_COSINE))[:5]:
        failures.append(f"cosine {cosines[i]:.6f} < {MIN_COSINE} for text {texts[i][:60]!r}")
    # ST's own tokenizer must see the same number of tokens as the counter used for tokens/s.
    preprocess = getattr(st_model, "preprocess", None) or st_model.tokenize  # `tokenize` before ST 6
    st_tokens = preprocess(texts)["attention_mask"].sum(dim=1).tolist()
    if st_tokens != counter.count(texts):
        failures.append("sentence-transformers' tokenizer counts differ from tokenizer.json's")
    summary = f"{len(texts)} vectors in {len(requests)} requests, min cosine {float(np.min(cosines)):.7f} (need >= {MIN_COSINE})"
    return failures, summary


# --- report -------------------------------------------------------------------------------------

_COLUMNS = [
    ("workload", 8, lambda r: r.workload),
    ("runner", 18, lambda r: r.runner),
    ("clients", 7, lambda r: "-" if r.clients is None else r.clients),
    ("items/req", 9, lambda r: r.items_per_request),
    ("requests", 8, lambda r: r.requests),
    ("items", 7, lambda r: r.items),
    ("tokens", 8, lambda r: r.tokens),
    ("wall s", 7, lambda r: f"{r.wall_s:.2f}"),
    ("req/s", 8, lambda r: f"{r.requests_per_s:.1f}"),
    ("items/s", 8, lambda r: f"{r.items_per_s:.1f}"),
    ("tokens/s", 9, lambda r: f"{r.tokens_per_s:.0f}"),
    ("p50 ms", 7, lambda r: "-" if r.p50_ms is None else f"{r.p50_ms:.1f}"),
    ("p95 ms", 7, lambda r: "-" if r.p95_ms is None else f"{r.p95_ms:.1f}"),
    ("p99 ms", 7, lambda r: "-" if r.p99_ms is None else f"{r.p99_ms:.1f}"),
    ("cpu cli/srv", 11, lambda r: _cores(r)),
    ("vs ST", 6, lambda r: "base" if r.vs_baseline is None else f"{r.vs_baseline:.2f}x"),
]


def _cores(row: Row) -> str:
    if row.client_cpu_cores is None:
        return "-"
    server = "?" if row.server_cpu_cores is None else f"{row.server_cpu_cores:.2f}"
    return f"{row.client_cpu_cores:.2f}/{server}"


def print_table(rows: list[Row]) -> None:
    print("  ".join(f"{name:>{width}}" for name, width, _ in _COLUMNS))
    for row in rows:
        print("  ".join(f"{str(get(row)):>{width}}" for _, width, get in _COLUMNS))


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="use this running server instead of spawning `shoal serve`")
    p.add_argument(
        "--duration-s",
        type=float,
        default=20.0,
        help="seconds each HTTP run keeps sending (default 20); requests in flight then are awaited and counted",
    )
    p.add_argument("--requests", type=int, help="single workload: this many requests instead of --duration-s")
    p.add_argument("--batch-requests", type=int, help="batch workload: this many requests instead of --duration-s")
    p.add_argument("--concurrency", type=int, default=32, help="clients in the single workload (default 32)")
    p.add_argument("--batch-clients", type=int, default=4, help="clients in the batch workload (default 4)")
    p.add_argument("--msgpack", action="store_true", help="also run each workload with msgpack bodies")
    p.add_argument("--workloads", default="single,batch", help="comma-separated subset of single,batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, help="write the figures and settings as JSON here")
    args = p.parse_args(argv)
    args.workloads = [n.strip() for n in args.workloads.split(",") if n.strip()]
    if not args.workloads or not set(args.workloads) <= {"single", "batch"}:
        p.error("--workloads takes a comma-separated subset of single,batch")
    return args


async def bench(args: argparse.Namespace, url: str, server_pid: int | None, header: list[str]) -> int:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    from shoal.catalog import Catalog, resolve_weights

    model_dir = resolve_weights(Catalog.load().get(MODEL), allow_download=False)
    # The server runs with torch's default thread count (shoal never sets it); so does the baseline.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    transformers.logging.disable_progress_bar()
    st_model = SentenceTransformer(str(model_dir), device="cpu")
    counter = TokenCounter(model_dir)
    sentences, groups = make_texts(load_words(model_dir), args.seed)
    workloads = {
        "single": Workload(
            "single", [[s] for s in sentences], counter.count(sentences), args.concurrency, ST_DEFAULT_BATCH_SIZE, True
        ),
        "batch": Workload(
            "batch", groups, [sum(counter.count(g)) for g in groups], args.batch_clients, GROUP_SIZE, False
        ),
    }
    codecs = [Codec("json")] + ([Codec("msgpack")] if args.msgpack else [])

    group_tokens = counter.count(list(itertools.chain.from_iterable(groups)))
    load1, load5, load15 = os.getloadavg()
    header += [
        f"model dir:   {model_dir}",
        f"torch:       {torch.__version__}, {num_threads} intra-op threads for the baseline "
        + ("(= the spawned server's default)" if server_pid else "(the --url server's count is unknown)"),
        f"texts:       seed {args.seed}; single: 6-24 words ({min(workloads['single'].tokens)}-{max(workloads['single'].tokens)} tokens); "
        f"batch: {GROUP_SIZE} texts of {min(group_tokens)}-{max(group_tokens)} tokens",
        f"load avg:    {load1:.2f} {load5:.2f} {load15:.2f} at start (other processes on this machine skew every figure)",
    ]
    print("\n".join(header), flush=True)

    limits = httpx.Limits(max_connections=max(args.concurrency, args.batch_clients) + 4, max_keepalive_connections=None)
    rows: list[Row] = []
    failures: list[str] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(120.0)) as client:
        st_model.encode(groups[0], batch_size=GROUP_SIZE, show_progress_bar=False)  # baseline warm-up
        for codec in codecs:
            await warm_up(client, codec, workloads["single"], 2 * args.concurrency)
            await warm_up(client, codec, workloads["batch"], args.batch_clients)
            check_failures, summary = await check_correctness(client, codec, st_model, counter, sentences, groups)
            print(f"correctness: {codec.name}: {summary}: {'FAILED' if check_failures else 'ok'}", flush=True)
            if check_failures:
                print("\n".join(f"  {f}" for f in check_failures), file=sys.stderr)
                return 1
        print(flush=True)
        for name in args.workloads:
            work = workloads[name]
            max_requests = args.requests if name == "single" else args.batch_requests
            for codec in codecs:
                http_row = await run_http(
                    client, codec, work, duration_s=args.duration_s, max_requests=max_requests, server_pid=server_pid
                )
                base_row = run_baseline(st_model, work, http_row.requests)  # the server is idle now
                http_row.vs_baseline = http_row.tokens_per_s / base_row.tokens_per_s
                rows += [http_row, base_row]
                failures += [f"{name} {codec.name}: {e}" for e in http_row.errors]
    print_table(rows)
    print()
    for row in rows:
        if row.server_mean_ms and row.p50_ms is not None:
            ms = row.server_mean_ms
            print(
                f"{row.workload} {row.runner}: server-side mean ms tokenize {ms['tokenize']:.1f}, queue {ms['queue']:.1f},"
                f" inference {ms['inference']:.1f}, total {ms['total']:.1f}; client-side mean {row.mean_ms:.1f}"
            )
    print(
        "\nvs ST: shoal tokens/s over ST's on exactly the texts of the HTTP run above it; ST's req/s counts those"
        " requests' texts.\ncpu cli/srv: cores used by this script's client and by the server process during the"
        " HTTP run (both on this machine)."
    )
    if args.json_out:
        record = {
            "model": MODEL,
            "url": url,
            "spawned_server": server_pid is not None,
            "torch_threads": num_threads,
            "cpu_count": os.cpu_count(),
            "loadavg_at_start": [load1, load5, load15],
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": [
                asdict(r)
                | {"requests_per_s": r.requests_per_s, "items_per_s": r.items_per_s, "tokens_per_s": r.tokens_per_s}
                for r in rows
            ],
        }
        args.json_out.write_text(json.dumps(record, indent=2))
    if failures:
        print(f"\nFAILED: {len(failures)} request errors or token-count mismatches, e.g.:", file=sys.stderr)
        print("\n".join(f"  {f}" for f in failures[:10]), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = [
        f"shoal encode throughput: {MODEL}",
        machine_line(note="client, server and baseline share them (HTTP runs and baselines run one after the other)"),
    ]
    if args.url:
        header.append(f"server:      {args.url} (--url)")
        return asyncio.run(bench(args, args.url.rstrip("/"), None, header))
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        log_path = Path(tmp) / "server.log"
        with spawned_server(free_port(), [MODEL], [], log_path) as (url, pid):
            header.append(f"server:      spawned `shoal serve --preload {MODEL}` at {url} (pid {pid})")
            code = asyncio.run(bench(args, url, pid, header))
        if code != 0 and log_path.stat().st_size:
            print(f"server log (tail):\n{log_tail(log_path)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
