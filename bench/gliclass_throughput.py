"""GLiClass throughput (extract kind gliclass): shoal's engine in process against the `gliclass`
package's ZeroShotClassificationPipeline in process, on the same texts and labels, outputs checked
equal, measured in the same run.

The model is a random-initialised GLiClass uni-encoder (simple scorer, first-token pooling) built
with the `gliclass` package (tests/test_gliclass.py's builder) on a DeBERTa-v3 backbone of
deberta-v3-xsmall's size by default (hidden 384, 6 layers, 6 heads, intermediate 1536; no GLiClass
weights ship on PyPI), with the tests' 1,500-piece Unigram tokenizer. Texts: the Lee news corpus
gensim ships, each document cut to a seeded 20..120 words; labels: five topics.

What is timed, per text: from the string to its labels. shoal: `ExtractCall`s of
--texts-per-request texts from --clients concurrent callers through `Engine.run`. gliclass: the
pipeline over the pool at each of --batch-sizes, best reported. The sides take turns (--rounds),
--duration-s each a round. Before timing, shoal's labels and scores for the first 16 texts are
compared with the pipeline's (the same labels, scores within 1e-4), or the run exits 1.

    python bench/gliclass_throughput.py --duration-s 20 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from classify_throughput import lee_pool
from spawn import machine_line

MODEL_ID = "test/gliclass"  # the tests' card builder names it so
LABELS = ["politics", "sport", "business", "science", "weather"]
SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536)
AIM = 1.5


def tests():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_gliclass

    return test_gliclass


async def main(args: argparse.Namespace) -> int:
    import os

    import torch

    from shoal.calls import ExtractCall
    from shoal.config import EngineSettings
    from shoal.engine import Engine

    load = os.getloadavg()
    t = tests()
    pool = lee_pool(args.pool)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "gliclass"
        reference = t.build_gliclass(directory, seed=1, shape=SHAPE)
        pipe = t.pipeline(reference, "multi-label")
        engine = Engine(EngineSettings(), t.catalog_with(Path(tmp), t.card(directory)), allow_download=False)
        await engine.start()

        async def labels_of(texts: list[str]):
            result = await engine.run(ExtractCall(model=MODEL_ID, items=texts, labels=LABELS, threshold=0.0))
            return result.items

        try:
            got = await labels_of(pool[:16])
            with torch.inference_mode():
                want = pipe(pool[:16], LABELS, threshold=0.0)
            for i, (item, expected) in enumerate(zip(got, want)):
                try:
                    t.assert_same(expected, item.labels, f"text {i}")
                except AssertionError as exc:
                    print(f"outputs differ: {exc}", file=sys.stderr)
                    return 1
            print(machine_line(load, f"torch threads {torch.get_num_threads()}"))
            print("outputs:     labels and scores of 16 texts equal the gliclass pipeline's (<= 1e-4)")

            async def shoal_for(seconds: float) -> float:
                done, start = 0, time.perf_counter()

                async def client(k: int) -> None:
                    nonlocal done
                    i = k * args.texts_per_request
                    while time.perf_counter() - start < seconds:
                        await labels_of([pool[(i + j) % len(pool)] for j in range(args.texts_per_request)])
                        done += args.texts_per_request
                        i += args.clients * args.texts_per_request

                await asyncio.gather(*(client(k) for k in range(args.clients)))
                return done / (time.perf_counter() - start)

            def reference_for(seconds: float, batch_size: int) -> float:
                done, i, start = 0, 0, time.perf_counter()
                with torch.inference_mode():
                    while time.perf_counter() - start < seconds:
                        chunk = [pool[(i + j) % len(pool)] for j in range(batch_size * 2)]
                        pipe(chunk, LABELS, threshold=0.0, batch_size=batch_size)
                        done += len(chunk)
                        i += len(chunk)
                return done / (time.perf_counter() - start)

            await shoal_for(2.0)  # warm
            ours, theirs = [], []
            for r in range(args.rounds):
                ours.append(await shoal_for(args.duration_s))
                theirs.append(max(reference_for(args.duration_s / len(args.batch_sizes), b) for b in args.batch_sizes))
                print(
                    f"round {r + 1}:     shoal {ours[-1]:.1f} texts/s, gliclass best {theirs[-1]:.1f} texts/s, "
                    f"{ours[-1] / theirs[-1]:.2f}x"
                )
            print(
                f"shoal:       {sum(ours) / len(ours):.1f} texts/s ({args.clients} clients x {args.texts_per_request})"
            )
            print(f"gliclass:    {sum(theirs) / len(theirs):.1f} texts/s (best of batch sizes {args.batch_sizes})")
            print(f"ratio:       {sum(ours) / sum(theirs):.2f}x (aim {AIM}x)")
        finally:
            await engine.stop()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--texts-per-request", type=int, default=8)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--pool", type=int, default=256)
    sys.exit(asyncio.run(main(parser.parse_args())))
