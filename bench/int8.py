"""int8 on CPU (`quantize: int8`): tokens/s of shoal's forward in float32 and in int8, and what
int8 costs in quality, measured in the same run on the same batches.

Models: sentence-transformers/all-MiniLM-L6-v2, and all-mpnet-base-v2 when its weights are installed
(`--models` to choose); real weights, resolved offline. Each is loaded twice, as its card says
(float32) and with `quantize: int8` (the card through `msgspec.structs.replace`, as a card of
one's own with `quantize: int8` says); both share torch's intra-op threads.

`--row-block-bytes B1,B2` loads each variant once per value of the CPU feed-forward's row blocks
(`batching.row_block_bytes`, layers/rows.py; 0: whole batches), so the row blocks' gain on each is
measured in the same run; ratios are int8 over float32 at the same value.

Speed: the first --num-docs documents of gensim's Lee background corpus, tokenized by the model's
tokenizer (truncated to its max_length) and packed in order into batches of at most --batch-tokens
tokens; one timed pass is `ModelRunner.forward` over every batch (the encoder, mean pooling,
normalisation), with glibc's malloc set as the server sets it. After a warm-up pass of each, the
variants take turns, one pass each, --rounds times, so a change in the machine's load falls on all;
the median pass of each is reported, as tokens/s.

Quality: the 50 documents of the Lee similarity set (1,225 pairs scored by people): Spearman
correlation of the vectors' cosines with the human scores, for each, and the smallest cosine between
a document's int8 vector and its float32 one; also the smallest over 300 single words and over the
first 155 sentences of those documents (short inputs are int8's hardest case).

    python bench/int8.py
    python bench/int8.py --models sentence-transformers/all-MiniLM-L6-v2 --rounds 9
    python bench/int8.py --row-block-bytes 0,3145728
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
from scipy.stats import spearmanr

from spawn import machine_line

MODELS = ("sentence-transformers/all-MiniLM-L6-v2", "sentence-transformers/all-mpnet-base-v2")


def lee_files() -> Path:
    spec = importlib.util.find_spec("gensim")  # data files only: gensim itself is not imported
    return Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"


def read_docs(path: Path) -> list[str]:
    return [line.decode("latin-1").strip() for line in path.read_bytes().splitlines() if line.strip()]


def spearman(vectors: np.ndarray, human: np.ndarray) -> float:
    """Spearman of the pairwise cosines (upper triangle) with the human scores (tests/test_quality.py)."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = unit @ unit.T
    return float(spearmanr(cosine[np.triu_indices(len(vectors), 1)], human).correlation)


def batches(runner, texts: list[str], max_tokens: int) -> list:
    """`texts` tokenized and packed in order into batches of at most `max_tokens` tokens."""
    from shoal.engine.types import Batch

    out, current, size = [], [], 0
    for seq in runner.tokenizer.encode(texts, truncate=True):
        if current and size + len(seq) > max_tokens:
            out.append(Batch.pack(current))
            current, size = [], 0
        current.append(seq)
        size += len(seq)
    return out + [Batch.pack(current)]


def vectors(runner, texts: list[str], max_tokens: int = 4096) -> np.ndarray:
    from shoal.engine.types import EncodeSpec

    spec = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")
    return np.concatenate(
        [
            np.stack([item.dense for item in runner.forward(batch, [spec] * batch.num_seqs)])
            for batch in batches(runner, texts, max_tokens)
        ]
    )


def one_pass(runner, work: list) -> float:
    from shoal.engine.types import EncodeSpec

    spec = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")
    start = time.perf_counter()
    for batch in work:
        runner.forward(batch, [spec] * batch.num_seqs)
    return time.perf_counter() - start


def bench_model(model_id: str, args: argparse.Namespace) -> bool:
    from shoal.catalog import Catalog, resolve_weights
    from shoal.engine.runner import ModelRunner
    from shoal.errors import ModelLoadError

    card = Catalog.load().get(model_id)
    try:
        directory = resolve_weights(card, allow_download=False)
    except ModelLoadError as exc:
        print(f"{model_id}: skipped, weights not installed ({exc})")
        return False
    from shoal.engine.hardware import hardware_class

    hardware = hardware_class("cpu")

    def variant(quantize: str | None, row_block_bytes: int | None):
        # The class's limits, with quantize named (a card's or overlay's `batching.quantize` would
        # otherwise choose for both) and the row blocks asked for (None: the card's).
        own = card.batching_for(hardware)
        limits = msgspec.structs.replace(own, quantize=quantize or "none")
        if row_block_bytes is not None:
            limits = msgspec.structs.replace(limits, row_block_bytes=row_block_bytes)
        chosen = msgspec.structs.replace(card, quantize=quantize, batching={hardware: limits})
        return ModelRunner.from_dir(chosen, directory, "cpu")

    blocks = args.row_block_bytes or [None]
    suffix = {b: "" if b is None else f" rows {b}" for b in blocks}
    runners = {}
    for b in blocks:
        runners[f"float32{suffix[b]}"] = variant(None, b)
        runners[f"int8{suffix[b]}"] = variant("int8", b)

    data = lee_files()
    work = batches(
        next(iter(runners.values())), read_docs(data / "lee_background.cor")[: args.num_docs], args.batch_tokens
    )
    num_tokens = sum(batch.num_tokens for batch in work)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for runner in runners.values():  # warm-up
        one_pass(runner, work)
    for _ in range(args.rounds):  # one pass of each in turn: the machine's load falls on both
        for name, runner in runners.items():
            times[name].append(one_pass(runner, work))

    docs = read_docs(data / "lee.cor")
    human = np.loadtxt(data / "similarities0-1.txt")[np.triu_indices(50, 1)]
    words = sorted({w.strip(".,\"'()") for doc in docs for w in doc.split()} - {""})[:300]
    sentences = [s for doc in docs for s in doc.split(". ") if s][:155]
    quality = {
        name: {
            kind: vectors(runner, texts) for kind, texts in (("docs", docs), ("words", words), ("sentences", sentences))
        }
        for name, runner in runners.items()
    }
    rho = {name: spearman(quality[name]["docs"], human) for name in runners}

    print(
        f"{model_id}: {len(work)} batches, {num_tokens} tokens ({args.num_docs} Lee background documents, "
        f"<= {args.batch_tokens} tokens a batch); median of {args.rounds} passes each"
    )
    first = statistics.median(times[f"float32{suffix[blocks[0]]}"])
    for name, runner in runners.items():
        median = statistics.median(times[name])
        print(
            f"  {name:22s} {num_tokens / median:8.0f} tokens/s  {first / median:.2f}x the first  "
            f"(passes {min(times[name]):.2f}-{max(times[name]):.2f} s)  weights+heads {runner.num_bytes / 2**20:6.1f} MiB  "
            f"Lee Spearman {rho[name]:.4f}"
        )
    for b in blocks:
        f32, i8 = f"float32{suffix[b]}", f"int8{suffix[b]}"
        cos_min = {
            kind: float((quality[i8][kind] * quality[f32][kind]).sum(1).min())
            for kind in ("docs", "sentences", "words")
        }
        print(
            f"  {i8} vs {f32}: {statistics.median(times[f32]) / statistics.median(times[i8]):.2f}x tokens/s; "
            f"Lee Spearman {rho[i8] - rho[f32]:+.4f}; cosine min: 50 documents "
            f"{cos_min['docs']:.4f}, {len(sentences)} sentences {cos_min['sentences']:.4f}, "
            f"{len(words)} words {cos_min['words']:.4f}"
        )
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--num-docs", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--row-block-bytes",
        type=lambda t: [int(v) for v in t.split(",") if v],
        metavar="B1,B2",
        help="CPU feed-forward row blocks to compare (0: whole batches; default: the card's)",
    )
    args = parser.parse_args()

    from shoal.engine import memory

    memory.tune_allocator()  # glibc's malloc as `shoal serve` sets it (engine/memory.py), before the models load
    load = os.getloadavg()
    vnni = "avx512_vnni" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    print(
        machine_line(
            load,
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{torch.backends.cpu.get_cpu_capability()}{', VNNI' if vnni else ''}",
        )
    )
    ran = [bench_model(model_id, args) for model_id in args.models]
    return 0 if any(ran) else 1


if __name__ == "__main__":
    sys.exit(main())
