"""One forward on every thread, or one forward per thread side by side (the device's lanes)?

MiniLM in process, Lee sentences packed `--per-batch` to a batch, every batch once per pass:

- `1 lane x 1 thread`: one forward at a time on one torch thread;
- `1 lane x 2 threads`: one forward at a time on two (a device with `--lanes 1` on 2 cores);
- `2 lanes x 1 thread`: two threads, each taking the next batch and running it on one torch thread
  (the default on a 2-core CPU, engine/device.py).

`--burn 0.3` adds a process that spins 3 ms of every 10 ms (~30 % of a core), as an HTTP server's event
loop and a load generator do. Passes alternate between the three; medians of `--rounds`.

    python bench/lanes.py --per-batch 16 [--burn 0.3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time

from int8 import lee_files, read_docs
from shoal.catalog import Catalog, resolve_weights
from shoal.engine import memory
from shoal.engine.runner import ModelRunner
from shoal.engine.threads import share_threads
from shoal.engine.types import Batch, EncodeSpec
from spawn import machine_line

SPEC = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")


def burn(share: float, stop) -> None:
    """Spin `share` of every 10 ms, sleep the rest."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < 0.01 * share:
            pass
        time.sleep(0.01 * (1 - share))


def one_lane(runner: ModelRunner, work: list, threads: int) -> float:
    runner.threads = threads
    start = time.perf_counter()
    for batch in work:
        runner.forward(batch, [SPEC] * batch.num_seqs)
    return time.perf_counter() - start


def lanes(runner: ModelRunner, work: list, count: int) -> float:
    runner.threads = count  # each lane takes 1/count of them: one thread
    batches = iter(work)
    lock = threading.Lock()

    def lane() -> None:
        share_threads(count)
        while True:
            with lock:
                batch = next(batches, None)
            if batch is None:
                return
            runner.forward(batch, [SPEC] * batch.num_seqs)

    threads = [threading.Thread(target=lane) for _ in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--per-batch", type=int, default=16, help="sentences per batch")
    parser.add_argument("--sentences", type=int, default=1600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burn", type=float, default=0.0, help="share of a core a side process takes")
    args = parser.parse_args()

    memory.tune_allocator()
    card = Catalog.load().get(args.model)
    runner = ModelRunner.from_dir(card, resolve_weights(card, allow_download=False), "cpu")
    runner.small_batch_tokens = 0  # the thread counts below are the ones that run
    text = " ".join(read_docs(lee_files() / "lee_background.cor"))
    sentences = [s.strip() + "." for s in text.split(". ") if len(s.split()) > 3][: args.sentences]
    seqs = runner.tokenizer.encode(sentences, truncate=True)
    work = [Batch.pack(seqs[i : i + args.per_batch]) for i in range(0, len(seqs), args.per_batch)]
    num_tokens = sum(batch.num_tokens for batch in work)
    print(machine_line())
    print(
        f"{args.model}: {len(work)} batches of {args.per_batch} sentences, mean {num_tokens / len(work):.0f} "
        f"tokens; side process {args.burn:.0%} of a core"
    )

    variants = {
        "1 lane x 1 thread": lambda: one_lane(runner, work, 1),
        "1 lane x 2 threads": lambda: one_lane(runner, work, 2),
        "2 lanes x 1 thread": lambda: lanes(runner, work, 2),
    }
    stop = multiprocessing.Event()
    side = None
    if args.burn:
        side = multiprocessing.Process(target=burn, args=(args.burn, stop), daemon=True)
        side.start()
    try:
        for run in variants.values():  # warm-up
            run()
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, run in variants.items():
                rates[name].append(num_tokens / run())
    finally:
        stop.set()
        if side is not None:
            side.join(5)
    base = statistics.median(rates["1 lane x 2 threads"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:20s} {median:8,.0f} tokens/s  {median / base:4.2f}x  ({', '.join(f'{v:,.0f}' for v in values)})")


if __name__ == "__main__":
    main()
