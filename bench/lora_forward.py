"""LoRA forward cost: `ModelRunner.forward` on one batch with no adapters against the same batch
spread over several adapters, in-process, measured in the same run.

Model: sentence-transformers/all-MiniLM-L6-v2 (6 layers, hidden 384), its real weights resolved
offline from the installed package. Adapters: --adapters (default 8) PEFT LoRA adapters of rank
--rank (default 8) on query, key, value and every `dense` (attention output, ffn in, ffn out; the
pooler's is dropped: an embedder never runs it), built with peft from seeded random factors and
saved as peft saves them, then loaded with `ModelRunner.add_adapter`.

Batch: --batch-size sequences (default 64) of seeded random ids, 20..40 tokens each (~30). Three
runs of the same batch: (a) base only (`adapter_slots` None); (b) sequence i on adapter i mod 8,
interleaved, so every adapter's rows are gathered; (c) the same adapters with each adapter's
sequences next to each other (its rows are a slice). After a warm-up the runs take turns, one
forward each, --iterations times, so a change in the machine's load falls on all of them; the
median forward of each is reported. Before timing, (b) and (c) are checked to give the same
vectors (<= 1e-5) and (a)'s base rows the same as (b)'s would without adapters.

    python bench/lora_forward.py
    python bench/lora_forward.py --device cuda --batch-size 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TARGETS = ["query", "key", "value", "dense"]


def build_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` peft LoRA adapters with seeded random factors on the model in `model_dir`."""
    import peft
    import transformers

    base = transformers.BertModel.from_pretrained(model_dir).eval()
    folders = []
    for i in range(count):
        torch.manual_seed(100 + i)
        tuned = peft.get_peft_model(
            base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        )
        with torch.no_grad():
            for name, param in tuned.named_parameters():
                if ".lora_" in name:
                    param.normal_(0.0, 0.1 * param.shape[1] ** -0.5)
        tuned.save_pretrained(out / f"adapter-{i}")
        folders.append(out / f"adapter-{i}")
        base = tuned.unload()  # the bare model back, for the next adapter
    return folders


def time_forward(runner, batch, specs, device: str, iterations: int) -> list[float]:
    times = []
    for _ in range(iterations):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        runner.forward(batch, specs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=15)
    args = parser.parse_args()

    import msgspec

    from shoal.catalog import Catalog, resolve_weights
    from shoal.engine.runner import ModelRunner
    from shoal.engine.tokenizer import Encoded
    from shoal.engine.types import Batch, EncodeSpec

    card = msgspec.structs.replace(Catalog.load().get(MODEL), dtype=args.dtype)
    model_dir = resolve_weights(card, allow_download=False)
    runner = ModelRunner.from_dir(card, model_dir, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        slots = [
            runner.add_adapter(f"a{i}", folder)
            for i, folder in enumerate(build_adapters(model_dir, Path(tmp), args.adapters, args.rank))
        ]

    rng = np.random.default_rng(0)
    seqs = [Encoded(rng.integers(1000, 30000, int(n)).astype(np.int64)) for n in rng.integers(20, 41, args.batch_size)]
    interleaved = [slots[i % len(slots)] for i in range(len(seqs))]
    order = np.argsort(interleaved, kind="stable")  # each adapter's sequences side by side
    grouped_seqs, grouped = [seqs[i] for i in order], [interleaved[i] for i in order]
    runs = {
        "base": Batch.pack(seqs),
        "interleaved": Batch.pack(seqs, interleaved),
        "grouped": Batch.pack(grouped_seqs, grouped),
    }
    specs = [EncodeSpec(normalize=False, dimensions=None, output_dtype="float32")] * len(seqs)
    num_tokens = runs["base"].num_tokens

    vectors = {name: np.stack([item.dense for item in runner.forward(batch, specs)]) for name, batch in runs.items()}
    diff = np.abs(vectors["interleaved"][order] - vectors["grouped"]).max()
    moved = np.abs(vectors["interleaved"] - vectors["base"]).max(axis=1).min()
    if diff > 1e-5 or moved < 1e-4:
        print(f"check failed: interleaved vs grouped differ by {diff}, adapters move outputs by {moved}")
        return 1

    times: dict[str, list[float]] = {name: [] for name in runs}
    for batch in runs.values():  # warm-up
        time_forward(runner, batch, specs, args.device, 2)
    for _ in range(args.iterations):  # one forward of each in turn: the machine's load falls on all
        for name, batch in runs.items():
            times[name] += time_forward(runner, batch, specs, args.device, 1)

    print(
        f"machine:     {os.cpu_count()} CPU cores, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"device {args.device}, {args.dtype}"
    )
    print(
        f"workload:    {len(seqs)} sequences, {num_tokens} tokens, {args.adapters} adapters r={args.rank} on "
        f"q,k,v,attn_out,ffn_in,ffn_out; median of {args.iterations} forwards each"
    )
    base = statistics.median(times["base"])
    for name in runs:
        median = statistics.median(times[name])
        print(f"{name:12s} {median * 1e3:8.2f} ms  {num_tokens / median:10.0f} tokens/s  ratio {base / median:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
