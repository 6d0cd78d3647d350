"""GLiREL relation throughput (extract kind glirel): shoal's engine in process against the `glirel`
package's `predict_relations` / `batch_predict_relations` in process, on the same texts, entities
and relation types, outputs checked equal, measured in the same run.

The model is a random-initialised GLiREL (markerv1 spans, ent_token labels, dot scorer, its
hidden size the backbone's) built with the `glirel` package (tests/test_glirel.py's builder) on a
DeBERTa-v3 backbone of deberta-v3-xsmall's size by default (hidden 384, 6 layers, 6 heads,
intermediate 1536; no GLiREL weights ship on PyPI), with the tests' 1,500-piece Unigram tokenizer.
Texts: the Lee news corpus gensim ships, each document cut to a seeded 20..120 words; entities: up
to four words of each text, capitalised ones first (`shoal bench`'s glirel workload,
workloads.glirel_schema), so up to 12 ordered pairs a text; relation types: the workload's four.

What is timed, per text: from the string and its entities to its relations. shoal: `ExtractCall`s
of --texts-per-request texts from --clients concurrent callers through `Engine.run`. glirel:
`batch_predict_relations` over the pool at each of --batch-sizes (1 is `predict_relations`), best
reported. The sides take turns (--rounds), --duration-s each a round. Before timing, shoal's
relations for the first 16 texts are compared with `predict_relations`' (the same pairs and types,
scores within 1e-4) at the timed threshold and at 0 (every pair and type, so every score), or the
run exits 1.

    python bench/glirel_throughput.py --duration-s 20 --rounds 3
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

THRESHOLD = 0.5
SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536)
AIM = 1.5


def tests():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_glirel

    return test_glirel


async def main(args: argparse.Namespace) -> int:
    import os

    import torch

    from shoal.bench.workloads import GLIREL_TYPES, glirel_schema
    from shoal.calls import ExtractCall
    from shoal.config import EngineSettings
    from shoal.engine import Engine
    from shoal.spans import split_words

    load = os.getloadavg()
    t = tests()
    types = list(GLIREL_TYPES)
    pool = lee_pool(args.pool)
    entities = glirel_schema(tuple(pool))["entities"]  # per text, [{start, end, label}]

    def words_of(text: str, found: list[dict]) -> list[tuple[int, int]]:
        """The entities as (first word, last word), the package's `ner` form."""
        _, starts, ends = split_words(text)
        first, last = {int(s): w for w, s in enumerate(starts)}, {int(e): w for w, e in enumerate(ends)}
        return [(first[e["start"]], last[e["end"]]) for e in found]

    ner = [words_of(text, found) for text, found in zip(pool, entities)]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "glirel"
        reference = t.build_glirel(directory, seed=3, shape=SHAPE, hidden_size=SHAPE["hidden_size"])
        engine = Engine(EngineSettings(), t.catalog_with(Path(tmp), t.card(directory)), allow_download=False)
        await engine.start()

        async def relations_of(indices: list[int], threshold: float = THRESHOLD):
            call = ExtractCall(
                model=t.MODEL,
                items=[pool[i] for i in indices],
                labels=types,
                threshold=threshold,
                schema={"entities": [entities[i] for i in indices]},
            )
            return (await engine.run(call)).items

        try:
            found = 0
            # At the timed threshold, and at 0 (every pair and type a relation: every score compared).
            for threshold in (THRESHOLD, 0.0):
                got = await relations_of(list(range(16)), threshold)
                for i, item in enumerate(got):
                    with torch.inference_mode():
                        want = t.expected(reference, pool[i], ner[i], types, threshold)
                    found += sum(len(v) for v in want.values())
                    try:
                        t.assert_same(want, item, pool[i], f"text {i}, threshold {threshold}")
                    except AssertionError as exc:
                        print(f"outputs differ: {exc}", file=sys.stderr)
                        return 1
            pairs = sum(len(n) * (len(n) - 1) for n in ner) / len(ner)
            print(machine_line(load, f"torch threads {torch.get_num_threads()}"))
            print(f"outputs:     {found} relations of 16 texts equal predict_relations' at {THRESHOLD} and 0 (<= 1e-4)")
            print(f"workload:    {pairs:.1f} ordered entity pairs a text x {len(types)} relation types")

            async def shoal_for(seconds: float) -> float:
                done, start = 0, time.perf_counter()

                async def client(k: int) -> None:
                    nonlocal done
                    i = k * args.texts_per_request
                    while time.perf_counter() - start < seconds:
                        await relations_of([(i + j) % len(pool) for j in range(args.texts_per_request)])
                        done += args.texts_per_request
                        i += args.clients * args.texts_per_request

                await asyncio.gather(*(client(k) for k in range(args.clients)))
                return done / (time.perf_counter() - start)

            def reference_for(seconds: float, batch_size: int) -> float:
                done, i, start = 0, 0, time.perf_counter()
                with torch.inference_mode():
                    while time.perf_counter() - start < seconds:
                        for _ in range(2):
                            chunk = [(i + j) % len(pool) for j in range(batch_size)]
                            reference.batch_predict_relations(
                                [pool[c] for c in chunk],
                                types,
                                threshold=THRESHOLD,
                                ner=[[[a, b, "entity", ""] for a, b in ner[c]] for c in chunk],
                            )
                            done += len(chunk)
                            i += len(chunk)
                return done / (time.perf_counter() - start)

            await shoal_for(2.0)  # warm
            ours, theirs = [], []
            for r in range(args.rounds):
                ours.append(await shoal_for(args.duration_s))
                theirs.append(max(reference_for(args.duration_s / len(args.batch_sizes), b) for b in args.batch_sizes))
                print(
                    f"round {r + 1}:     shoal {ours[-1]:.1f} texts/s, glirel best {theirs[-1]:.1f} texts/s, "
                    f"{ours[-1] / theirs[-1]:.2f}x"
                )
            print(
                f"shoal:       {sum(ours) / len(ours):.1f} texts/s ({args.clients} clients x {args.texts_per_request})"
            )
            print(f"glirel:      {sum(theirs) / len(theirs):.1f} texts/s (best of batch sizes {args.batch_sizes})")
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
