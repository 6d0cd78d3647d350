"""Where shoal's time goes, per workload of issue 37's runtime comparison: a table of shares.

In process (the engine, no HTTP), one caller sending one call after another:
    minilm-docs     all-MiniLM-L6-v2, 32 Lee documents per call (`shoal bench --workload passages`)
    mpnet-docs      all-mpnet-base-v2, the same calls
    cross-encoder   bench/cards/minilm-l6-reranker.yaml: a Lee sentence against 20 Lee documents
                    (`--workload rerank`), (query, document) pairs through the score path
The forward is split by torch.profiler's self time per op on every thread (the engine runs a batch
per lane, side by side: 2 lanes on a 2-core CPU), grouped: matmul (the packed Linears:
`mkldnn::_linear_pointwise`, `addmm`, `mm`), attention (SDPA and what feeds it), layer norm, GELU,
data movement (copies, index, cat of the packed batch), other ops; beside them the op time per
second of wall time (2.00: both lanes in ops all the time; less: Python, waits, tokenize) and the
calls' `tokenize_s` (the tokenizer pool) as a share of the wall time.

Over HTTP:
    minilm-sentence-http   all-MiniLM-L6-v2 behind `shoal serve`, --clients closed-loop clients each
                           sending one Lee sentence per request (`--workload queries`)
The server's CPU seconds per request (from /proc, all its threads) against the same sentences'
forward in process (32 concurrent callers on the engine, profiled as above), and with py-spy (when
it is installed and may attach) the server's samples by where their Python stack is: the model's
forward, tokenize, HTTP (uvicorn, h11/httptools, starlette, shoal.api), wire (JSON/msgpack),
engine (scheduler, tasks, admission), asyncio's loop and idle threads.

Every model runs float32 (SHOAL_REDUCED_PRECISION=false); shares depend on the CPU (oneDNN's kernels
for it) and on what else runs: the figures are this machine's.

    python bench/profile_workloads.py --build-reranker          # once: the cross-encoder's folder
    python bench/profile_workloads.py --calls 8 --duration-s 15
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from spawn import machine_line

HERE = Path(__file__).resolve().parent
CARDS = HERE / "cards"
RERANKER = "shoal-bench/minilm-l6-reranker"
RERANKER_DIR = HERE / ".cache" / "minilm-l6-reranker"  # bench/cards/minilm-l6-reranker.yaml's source
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
MPNET = "sentence-transformers/all-mpnet-base-v2"
IN_PROCESS = {
    "minilm-docs": (MINILM, "passages"),
    "mpnet-docs": (MPNET, "passages"),
    "cross-encoder": (RERANKER, "rerank"),
}
HTTP = "minilm-sentence-http"

# torch.profiler op names -> group (first match wins; self time, so nesting is not counted twice).
OP_GROUPS = (
    ("matmul", ("_linear_pointwise", "addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul", "baddbmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "softmax", "_efficient_attention")),
    ("layer norm", ("layer_norm",)),
    ("GELU", ("gelu",)),
    ("data movement", ("copy_", "index", "cat", "pad", "clone", "contiguous", "to_copy", "split", "narrow", "fill")),
)
# py-spy stack frames (file paths) -> group, innermost match wins.
STACK_GROUPS = (
    ("forward", ("shoal/models/", "shoal/layers/", "shoal/heads/", "torch/")),
    ("tokenize", ("shoal/engine/tokenizer", "tokenizers/")),
    ("wire (JSON/msgpack)", ("shoal/wire/", "msgspec")),
    ("HTTP", ("uvicorn/", "h11/", "httptools/", "starlette/", "shoal/api/", "anyio/")),
    ("engine (scheduler, tasks)", ("shoal/engine/", "shoal/calls")),
    ("asyncio loop", ("asyncio/",)),
)


def build_reranker(directory: Path = RERANKER_DIR) -> Path:
    """The packaged all-MiniLM-L6-v2 encoder as a BertForSequenceClassification with a seeded
    one-logit head, saved with MiniLM's tokenizer (bench/score_throughput.py's cross-encoder)."""
    import torch
    import transformers

    from shoal.catalog import Catalog, resolve_weights

    minilm = resolve_weights(Catalog.load().get(MINILM), allow_download=False)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(minilm, num_labels=1)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, directory / name)
    return directory


def op_group(name: str) -> str:
    for group, needles in OP_GROUPS:
        if any(n in name for n in needles):
            return group
    return "other ops"


def engine_call(model: str, call):
    from shoal.engine import EncodeCall, ScoreCall

    if call.query is not None:
        return ScoreCall(model=model, query=call.query, documents=list(call.texts))
    return EncodeCall(model=model, items=list(call.texts))


async def _profile_engine(model: str, workload, num_calls: int, concurrency: int) -> dict:
    """Wall time of `num_calls` calls (`concurrency` at a time) on a fresh engine, split by the
    results' timings and torch.profiler's op groups."""
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from shoal.catalog import Catalog
    from shoal.config import EngineSettings
    from shoal.engine import Engine

    catalog = Catalog.load((CARDS,), strict=False)
    engine = Engine(EngineSettings(reduced_precision=False), catalog, allow_download=False)
    await engine.start()
    try:
        calls = [engine_call(model, workload.calls[k % len(workload.calls)]) for k in range(num_calls)]
        for call in calls[:2]:  # load and warm up
            await engine.run(call)
        timings: dict[str, float] = defaultdict(float)
        tokens = 0

        async def one(call) -> None:
            nonlocal tokens
            result = await engine.run(call)
            for key in ("tokenize_s", "queue_s", "inference_s"):
                timings[key] += getattr(result, key)
            tokens += result.num_tokens

        # Every thread's ops: the forward runs on the engine's device thread, not this one.
        every_thread = _ExperimentalConfig(profile_all_threads=True)
        with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
            start = time.perf_counter()
            for at in range(0, len(calls), concurrency):
                await asyncio.gather(*(one(c) for c in calls[at : at + concurrency]))
            wall_s = time.perf_counter() - start
        ops: dict[str, float] = defaultdict(float)
        for event in prof.key_averages():
            ops[op_group(event.key)] += event.self_cpu_time_total / 1e6
        return dict(
            wall_s=wall_s,
            timings=dict(timings),
            ops=dict(ops),
            calls=num_calls,
            tokens=tokens,
            threads=torch.get_num_threads(),
        )
    finally:
        await engine.stop()


def _in_process_row(name: str, measured: dict) -> list[str]:
    """The op groups' shares of the forward's op time (summed over the threads that ran ops: on a
    CPU the engine runs a batch per lane, side by side), the threads' op time per second of wall
    time (2 lanes busy all the time: 2.00), and tokenize's share of the wall time."""
    wall, ops = measured["wall_s"], measured["ops"]
    op_total = sum(ops.values()) or 1e-9
    cells = [name, f"{1000 * wall / measured['calls']:,.0f}", f"{measured['tokens'] / wall:,.0f}"]
    cells += [f"{100 * ops.get(group, 0.0) / op_total:.1f}" for group in COLUMNS]
    cells += [f"{op_total / wall:.2f}", f"{100 * measured['timings']['tokenize_s'] / wall:.1f}"]
    return cells


COLUMNS = ("matmul", "attention", "layer norm", "GELU", "data movement", "other ops")


def _stack_group(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for group, needles in STACK_GROUPS:
            if any(n in frame for n in needles):
                return group
    return "other Python"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _http_load(url: str, workload, clients: int, duration_s: float):
    from shoal.bench.load import HttpTarget, closed_loop

    target = HttpTarget("shoal", url, MINILM, workload)
    try:
        await closed_loop(target, clients, 3.0)  # warm-up
        return await closed_loop(target, clients, duration_s)
    finally:
        await target.aclose()


def profile_http(workload, clients: int, duration_s: float, py_spy: str | None) -> tuple[dict, dict[str, int] | None]:
    """Requests/s, server and client CPU per request, and py-spy's samples of the server by group."""
    from shoal.bench.targets import shoal_serve

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "SHOAL_REDUCED_PRECISION": "false"}
        with shoal_serve(MINILM, Path(tmp) / "serve.log", env=env) as (url, pid):
            spy = None
            if py_spy:
                raw = Path(tmp) / "spy.txt"
                spy = subprocess.Popen(
                    [py_spy, "record", "--pid", str(pid), "--duration", str(int(duration_s) + 2), "--rate", "50"]
                    + ["--format", "raw", "--output", str(raw), "--nonblocking"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            cpu0, client0 = _cpu_s(pid), time.process_time()
            step = asyncio.run(_http_load(url, workload, clients, duration_s))
            server_cpu, client_cpu = _cpu_s(pid) - cpu0, time.process_time() - client0
            groups: dict[str, int] | None = None
            if spy is not None:
                _, err = spy.communicate(timeout=60)
                if spy.returncode == 0 and raw.exists():
                    groups = defaultdict(int)
                    for line in raw.read_text().splitlines():
                        stack, _, count = line.rpartition(" ")
                        groups[_stack_group(stack.split(";"))] += int(count)
                else:
                    print(f"py-spy could not sample the server: {err.decode(errors='replace').strip()[:300]}")
    ok = step.ok
    figures = dict(
        rps=step.achieved_rps,
        tokens_per_s=step.tokens_per_s,
        server_cpu_ms=1000 * server_cpu / max(ok, 1),
        client_cpu_ms=1000 * client_cpu / max(ok, 1),
        requests=ok,
    )
    return figures, groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = (*IN_PROCESS, HTTP)
    parser.add_argument("--workloads", default=",".join(names), help=f"comma-separated, of {', '.join(names)}")
    parser.add_argument("--calls", type=int, default=8, help="calls timed per in-process workload")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients of the HTTP workload")
    parser.add_argument("--duration-s", type=float, default=15.0, help="seconds of HTTP load")
    parser.add_argument("--build-reranker", action="store_true", help="write the cross-encoder's folder and exit")
    args = parser.parse_args()
    if args.build_reranker:
        print(f"wrote {build_reranker()}")
        return 0
    from shoal.bench import workloads

    chosen = [w for w in args.workloads.split(",") if w]
    unknown = set(chosen) - set(names)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(names)}")
    if "cross-encoder" in chosen and not (RERANKER_DIR / "config.json").exists():
        build_reranker()
    print(machine_line(os.getloadavg(), "float32 everywhere"))
    header = ["workload", "ms/call", "tokens/s", *COLUMNS, "op s/s", "tokenize % of wall"]
    rows = []
    for name in chosen:
        if name == HTTP:
            continue
        model, kind = IN_PROCESS[name]
        measured = asyncio.run(_profile_engine(model, workloads.build(kind, seed=0), args.calls, 1))
        rows.append(_in_process_row(name, measured))
    if HTTP in chosen:
        queries = workloads.build("queries", seed=0)
        measured = asyncio.run(_profile_engine(MINILM, queries, 32 * args.calls, 32))
        rows.append(_in_process_row("minilm-sentence, 32 callers in process", measured))
        # The forward's ops per sentence, summed over the lanes' threads (a lane's ops run on its thread).
        per_request_forward_ms = 1000 * sum(measured["ops"].values()) / measured["calls"]
    print("op groups: % of the forward's op time (all threads); op s/s: op time per second of wall time")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if HTTP in chosen:
        beside = Path(sys.executable).parent / "py-spy"
        py_spy = str(beside) if beside.exists() else shutil.which("py-spy")
        http, groups = profile_http(queries, args.clients, args.duration_s, py_spy)
        print(
            f"\n{HTTP}: {args.clients} clients, {http['rps']:.0f} req/s, {http['tokens_per_s']:,.0f} tokens/s over "
            f"{http['requests']} requests: {1000 / http['rps']:.2f} ms of wall time a request; CPU a request: "
            f"server {http['server_cpu_ms']:.2f} ms (all threads), load generator {http['client_cpu_ms']:.2f} ms; "
            f"the same sentences' ops in process (32 callers) {per_request_forward_ms:.2f} ms of thread time a "
            f"request ({100 * per_request_forward_ms / http['server_cpu_ms']:.0f} % of the server's CPU)"
        )
        if groups:
            total = sum(groups.values())
            print("server samples by Python stack (py-spy, all threads, idle excluded), %:")
            print("| " + " | ".join(g for g, _ in sorted(groups.items(), key=lambda kv: -kv[1])) + " |")
            print("|" + "---|" * len(groups))
            print(
                "| "
                + " | ".join(f"{100 * n / total:.1f}" for _, n in sorted(groups.items(), key=lambda kv: -kv[1]))
                + " |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
