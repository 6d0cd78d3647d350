"""The `shoal bench` and `shoal tune` subcommands (their modules load only when run)."""

from __future__ import annotations

import argparse
import math


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, not {text!r}") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers > 0, not {text!r}")
    return values


def _clients(text: str) -> list[float]:
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"client counts are whole numbers >= 1, not {text!r}")
    return values


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, not {text!r}")
    return value


def _cosine(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not -1 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a cosine between -1 and 1, not {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {text!r}")
    return value


def cmd_bench(args: argparse.Namespace) -> int:
    from .run import run

    return run(args)


def cmd_tune(args: argparse.Namespace) -> int:
    from .tune import tune

    return tune(args)


def register(sub) -> None:
    from .workloads import MODALITIES, WORKLOADS

    def models_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--models-dir",
            action="append",
            metavar="DIR",
            help="model cards (and tuned/ overlays) of one's own, as `shoal serve --models-dir`",
        )

    bench = sub.add_parser("bench", help="ramp the load on a server, find the knee, compare with ST / Infinity")
    models_dir(bench)
    bench.add_argument("model")
    bench.add_argument(
        "--workload",
        choices=(*WORKLOADS, "chat"),
        default="queries",
        help="queries (1 sentence), passages (32 docs), bulk (256), rerank, extract (8 tweets, or photos, "
        "sent as the card's extract kind reads them), images (16 photos; image models), chat (streamed chat "
        "completions at 1, 8, 32 at once: tokens/s and time to first token; generating models) (default queries)",
    )
    bench.add_argument("--items", type=_count, help="texts (images) per call (overrides the workload's)")
    bench.add_argument("--url", help="a running shoal server (default: start `shoal serve --preload MODEL`)")
    bench.add_argument("--api-key", help="bearer token for --url")
    bench.add_argument(
        "--mode",
        choices=("open", "closed"),
        default="open",
        help="open: Poisson arrivals at a rate; closed: N clients (default open)",
    )
    bench.add_argument(
        "--levels",
        type=_floats,
        metavar="L1,L2,...",
        help="rates (open) or client counts (closed); default: shares of a probed capacity / 1..64 clients",
    )
    bench.add_argument("--step-s", type=_seconds, default=10.0, help="seconds per level (default 10)")
    bench.add_argument(
        "--probe-clients", type=_count, help="clients of the capacity probe (default 32 for 1-2 texts, else 4)"
    )
    bench.add_argument(
        "--p99-ms",
        type=_seconds,
        help="the knee's p99 bound (default per workload: queries 150, passages 5000, bulk 20000, "
        "rerank and extract 1000)",
    )
    bench.add_argument("--msgpack", action="store_true", help="send and receive msgpack instead of JSON")
    bench.add_argument(
        "--against",
        action="append",
        metavar="st,infinity,ort,ort-int8,openvino,openvino-bf16|transformers,llama.cpp",
        help="also measure sentence-transformers in-process and/or Infinity on the same texts, and the CPU "
        "runtimes in-process on an ONNX export of the model (ONNX Runtime fp32 fused and dynamic int8, OpenVINO "
        "fp32 and bf16; each checked equal to shoal first; on rerank, a cross-encoder's pairs: the runtimes only); "
        "images: transformers' CLIPModel in-process on the same photos; chat: transformers' generate and/or "
        "llama.cpp (llama-cpp-python, on the card's GGUF file) in-process",
    )
    bench.add_argument(
        "--infinity", metavar="PATH", help="the infinity_emb script of a venv with infinity-emb[server,torch]"
    )
    bench.add_argument("--infinity-batch-size", type=_count, default=32, help="Infinity's --batch-size (default 32)")
    bench.add_argument("--json-out", metavar="FILE", help="write every level, knee and ratio as JSON")
    bench.add_argument("--png", metavar="FILE", help="plot throughput and p50/p99 against load, knees marked")
    bench.add_argument("--seed", type=int, default=0)
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser("tune", help="search batch limits, threads and int8 for MODEL here; write a tuned overlay")
    models_dir(tune)
    tune.add_argument("model")
    tune.add_argument(
        "--out", metavar="DIR", help="write DIR/tuned/<model>@<hardware>.yaml (default: the first --models-dir)"
    )
    tune.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    tune.add_argument(
        "--workload",
        choices=[w for w in WORKLOADS if w not in MODALITIES],  # texts: the quality gate compares text vectors
        help="default: passages (encode), rerank (score), extract",
    )
    tune.add_argument(
        "--clients",
        type=_clients,
        default=[1.0, 4.0, 16.0],
        metavar="C1,C2,...",
        help="closed-loop levels each setting is ramped through (default 1,4,16)",
    )
    tune.add_argument(
        "--items",
        type=_count,
        help="texts per call (overrides the workload's; fewer for big models, "
        "whose 32-document passages calls take longer than a step)",
    )
    tune.add_argument("--step-s", type=_seconds, default=4.0, help="seconds per level (default 4)")
    tune.add_argument(
        "--p99-ms",
        type=_seconds,
        help="a level counts only with p99 under this (default: the workload's, as for shoal bench)",
    )
    tune.add_argument(
        "--knobs",
        type=lambda t: [k for k in t.split(",") if k],
        metavar="K1,K2",
        help="which to search, in order (default max_batch_tokens,max_batch_items,batch_wait_ms,threads, "
        "and on a CPU attention and row_block_bytes, then quantize for a float32 dense encoder; "
        "lanes, the device's, on a CPU of 2+ cores, always first)",
    )
    tune.add_argument(
        "--grid",
        action="append",
        metavar="KNOB=V1,V2",
        default=[],
        help="the values tried for a knob (default max_batch_tokens=1024,...,16384; max_batch_items="
        "16,...,256; batch_wait_ms=0,2,5,10; threads=1,cores/2,cores; attention=padded,each; "
        "row_block_bytes=0,1048576,3145728,8388608; quantize=int8,none; lanes=1,2)",
    )
    tune.add_argument(
        "--confirm",
        type=int,
        default=2,
        metavar="N",
        help="turns the winner and the card's limits then take each, to keep the winner only if its "
        "mean still gains (default 2; 0: keep the search's pick)",
    )
    tune.add_argument(
        "--min-gain", type=float, default=0.03, help="keep a value only if it gains this share (default 0.03)"
    )
    tune.add_argument(
        "--min-cosine",
        type=_cosine,
        default=0.99,
        help="quantize: a candidate serves only if each of its dense vectors for the workload's first "
        "32 texts has at least this cosine to the card's own (default 0.99)",
    )
    tune.add_argument("--seed", type=int, default=0)
    tune.set_defaults(func=cmd_tune)
