"""The CPU attention paths, A/B in one process: a model's whole forward (`ModelRunner.forward`:
encoder, pooling, normalisation) over Lee documents with the "each" path on and off
(`layers.attention.EACH_MAX_SEQLEN` set to 0 sends every batch down the padded path), taking
turns pass by pass so a change in the machine's load falls on both; median pass of each.

Batches: the first --num-docs documents of gensim's Lee background corpus (one passages call's
worth, 32 by default), tokenized by the model's tokenizer (truncated to its max_length) and packed
in order into batches of at most --batch-tokens tokens, as the engine packs one call's texts.

    python bench/attention_paths.py
    python bench/attention_paths.py --model BAAI/bge-small-en-v1.5 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shoal.bench import workloads
from shoal.catalog import Catalog
from shoal.engine.runner import ModelRunner
from shoal.engine.types import Batch, EncodeSpec
from shoal.layers import attention
from spawn import machine_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--num-docs", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from shoal.engine import memory

    memory.tune_allocator()  # glibc's malloc as `shoal serve` sets it (engine/memory.py), before the models load
    print(machine_line())
    card = Catalog.load().get(args.model)
    runner = ModelRunner.load(card, "cpu", allow_download=False)
    assert runner.attention_each, "this CPU's limits for the card say attention: padded; nothing to compare"
    seqs = runner.tokenizer.encode(workloads.lee_documents()[: args.num_docs], truncate=True)
    batches, current = [], []
    for seq in seqs:
        if current and sum(map(len, current)) + len(seq) > args.batch_tokens:
            batches.append(current)
            current = []
        current.append(seq)
    batches.append(current)
    packed = [Batch.pack(b) for b in batches]
    tokens = sum(map(len, seqs))
    spec = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")
    bound = attention.EACH_MAX_SEQLEN

    def one_pass(each: bool) -> float:
        attention.EACH_MAX_SEQLEN = bound if each else 0
        start = time.perf_counter()
        with torch.inference_mode():
            for batch, group in zip(packed, batches):
                runner.forward(batch, [spec] * len(group))
        return time.perf_counter() - start

    first = [item.dense for b, g in zip(packed, batches) for item in runner.forward(b, [spec] * len(g))]
    one_pass(True), one_pass(False)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for each in (False, True):
            times[each].append(one_pass(each))
    attention.EACH_MAX_SEQLEN = 0
    padded = [item.dense for b, g in zip(packed, batches) for item in runner.forward(b, [spec] * len(g))]
    attention.EACH_MAX_SEQLEN = bound
    worst = min(float((a * b).sum()) for a, b in zip(first, padded))  # unit vectors: cosine
    print(
        f"{card.id}: {len(seqs)} Lee documents, {tokens} tokens, {len(batches)} batches of <= {args.batch_tokens} "
        f"tokens, max length {card.max_length}; median of {args.rounds} passes each"
    )
    for each, label in ((False, "padded groups"), (True, f"each (<= {bound} tokens)")):
        median = statistics.median(times[each])
        print(
            f"  {label:24s} {tokens / median:8.0f} tokens/s  (passes {min(times[each]):.2f}-{max(times[each]):.2f} s)"
        )
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"  each / padded: {ratio:.3f}x; smallest cosine between the two paths' vectors {worst:.7f}")


if __name__ == "__main__":
    main()
